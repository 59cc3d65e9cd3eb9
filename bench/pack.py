#!/usr/bin/env python
"""Packing benchmark: rows of each algorithm against the lower bound, and packer throughput against the raw tokenizer.

    python bench/pack.py                                   # all ../shared/data/chat/*.jsonl, SmolLM2 + Qwen2.5
    python bench/pack.py --data path/to/chat --tokenizers path/to/tok --max-seq-lens 4096 --workers 1 2
    python bench/pack.py --efficiency-only                 # skip the (slow) packer runs

Efficiency (``docs/packing.md``): for every input file and for all files together, with each tokenizer's chat
template, at each ``max_seq_len`` L and context-parallel size CP, the rows of next-fit, best-fit decreasing and
bfd-local-search against the lower bound ``ceil(sum(cost) / L)``, the default algorithm's efficiency = real
tokens / (rows * L) and its seconds. Token counts come from one raw encode of each conversation's full
chat-template rendering, computed once per tokenizer and file (the packer counts exactly these tokens: checked
against the packer's report below) and kept in ``--cache`` (keyed by the file's bytes, the tokenizer fingerprint
and the template); costs are :func:`packsft.layout.conversation_cost` (CP-padded) with the pipeline's oversize
rule (``own-row``: an oversize conversation costs L, a full row). Then the seconds of best-fit decreasing and
bfd-local-search on synthetic 100K-cost lists (log-normal lengths, the median about 245 tokens), per 100K
conversations (best of 3).

Throughput, per file (its first ``--throughput-limit`` conversations), with P processes and the first tokenizer:
the packer is :func:`packsft.packing.pipeline.run_pack` end to end (read, parse, render, tokenize with masking
checks, pack, write rows + sidecar + report; no histogram; tokenizer load and process start included) with
``num_workers=0`` for P=1 and ``num_workers=P`` otherwise; the raw baseline is
``tokenizer.backend_tokenizer.encode_batch`` of the same rendered texts in P processes (batches of 64,
``TOKENIZERS_PARALLELISM=false``; pool started and tokenizers loaded before timing). Both are in
conversations/s, with their ratio. Wall-clock times: on a shared machine they are noisy.

Exit code 1 when an algorithm uses more rows than best-fit decreasing or the packer's counts disagree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as in the packer's workers

from packsft.conversation import parse_record  # noqa: E402
from packsft.io import write_json_atomic  # noqa: E402
from packsft.layout import conversation_cost  # noqa: E402
from packsft.packing.algorithms import DEFAULT_ALGORITHM, lower_bound_rows, pack  # noqa: E402
from packsft.packing.pipeline import PackConfig, run_pack  # noqa: E402
from packsft.prompt_formats import get_prompt_format  # noqa: E402
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
BATCH = 64
COMPARED = ("next-fit", "best-fit-decreasing", "bfd-local-search")


def render_file(path: Path, tok, fmt) -> list[str]:
    """Full chat-template rendering of every conversation of ``path`` (one template call each).

    The packer renders the same text (plus one rendering per assistant turn for masking); tool-call arguments
    are left as the file has them (the chat files have no tool calls; the count check in
    :func:`print_throughput` would show a difference).
    """
    texts = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            conv = parse_record(json.loads(text), path, line)
            texts.append(tok.apply_chat_template(conv.messages, tools=conv.tools,
                                                 chat_template=fmt.chat_template, tokenize=False))
    return texts


_TOK: dict = {}


def _init_encoder(tokenizer: str) -> None:
    _TOK["tok"] = load_tokenizer(tokenizer)


def _encode_lengths(texts: list[str]) -> list[int]:
    return [len(e.ids) for e in _TOK["tok"].backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def raw_encode(texts: list[str], tokenizer: str, processes: int) -> tuple[list[int], float]:
    """Token count of each text and the wall seconds to encode them all in ``processes`` processes.

    With ``processes > 1`` the pool is started and its tokenizers loaded before the clock starts.
    """
    batches = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    if processes == 1:
        _init_encoder(tokenizer)
        t0 = time.perf_counter()
        out = [_encode_lengths(b) for b in batches]
        return [n for b in out for n in b], time.perf_counter() - t0
    with mp.get_context("spawn").Pool(processes, initializer=_init_encoder, initargs=(tokenizer,)) as pool:
        pool.map(_encode_lengths, [["warm-up"]] * processes, chunksize=1)
        t0 = time.perf_counter()
        out = pool.map(_encode_lengths, batches, chunksize=1)
        elapsed = time.perf_counter() - t0
    return [n for b in out for n in b], elapsed


def costs_of(lengths: list[int], max_seq_len: int, cp: int) -> list[int]:
    """Costs as the pipeline packs them: CP-padded, an oversize conversation (own-row) costs ``max_seq_len``."""
    return [min(conversation_cost(n, cp), max_seq_len) for n in lengths]


def efficiency_case(lengths: list[int], max_seq_len: int, cp: int) -> dict:
    """Rows of each algorithm in :data:`COMPARED`, the lower bound, and the default's efficiency and seconds."""
    costs = costs_of(lengths, max_seq_len, cp)
    out = {"bound": lower_bound_rows(costs, max_seq_len), "convs": len(lengths),
           "oversize": sum(n > max_seq_len for n in lengths), "real": sum(min(n, max_seq_len) for n in lengths)}
    for algorithm in COMPARED:
        t0 = time.perf_counter()
        out[algorithm] = len(pack(costs, max_seq_len, algorithm))
        out[algorithm + " s"] = time.perf_counter() - t0
    return out


def print_efficiency(lengths_by_tok: dict[str, dict[str, list[int]]], max_seq_lens: list[int], cps: list[int]) -> int:
    """Print one line per tokenizer, input, L and CP; return how many cases use more rows than best-fit decreasing.

    ``bound eff %`` is the efficiency of a packing with exactly the lower bound of rows: no algorithm does better.
    """
    nf, bfd, ls = COMPARED
    print(f"\n{'tokenizer':<22} {'input':<27} {'L':>5} {'cp':>2} {'convs':>6} {'oversize':>8} {'bound':>6} "
          f"{'bound eff %':>11} | {nf:>8} {bfd[:8]:>8} {ls[:8]:>8} | {'- bound':>7} {'eff %':>6} {'s':>5}")
    worse, at_bound, cases, gaps = 0, 0, 0, []
    for tok_name, lengths_by_name in lengths_by_tok.items():
        for L in max_seq_lens:
            for cp in cps:
                for name, lengths in lengths_by_name.items():
                    r = efficiency_case(lengths, L, cp)
                    worse += r[ls] > r[bfd]
                    cases += 1
                    at_bound += r[ls] == r["bound"]
                    if r[ls] > r["bound"]:
                        gaps.append(f"{tok_name} {name} L={L} cp={cp}: +{r[ls] - r['bound']}")
                    print(f"{tok_name:<22} {name.removesuffix('.messages.jsonl'):<27} {L:>5} {cp:>2} {r['convs']:>6} "
                          f"{r['oversize']:>8} {r['bound']:>6} {100 * r['real'] / (r['bound'] * L):>11.2f} | "
                          f"{r[nf]:>8} {r[bfd]:>8} {r[ls]:>8} | {r[ls] - r['bound']:>7} "
                          f"{100 * r['real'] / (r[ls] * L):>6.2f} {r[ls + ' s']:>5.2f}")
    print(f"{ls}: {at_bound}/{cases} cases at the lower bound"
          + (f"; above it: {', '.join(gaps)}" if gaps else "")
          + (f"; {worse} case(s) WORSE than best-fit decreasing" if worse else ""))
    return worse


def print_synthetic_speed(max_seq_lens: list[int], n: int = 100_000) -> None:
    """Seconds per 100K conversations of best-fit decreasing and bfd-local-search on synthetic costs (best of 3).

    Log-normal costs at each L (the realistic case), then three adversarial lists at L = 4096: uniform in 1..L,
    uniform in L/4..L/2 (3-4 per row: best-fit decreasing is far above the bound and the pass spends its budget),
    and all L/2 + 1 (one per row: no row can be removed).
    """
    print(f"\nsynthetic: {n} costs, CP 1, best of 3; log-normal = exp(N(5.5, 0.9)) + 1 tokens, capped at L")
    print(f"{'costs':<22} {'L':>5} {'bound':>6} {'bfd rows':>8} {'ls rows':>8} {'bfd s/100K':>10} {'ls s/100K':>10}")
    cases = []
    for L in max_seq_lens:
        rng = random.Random(1)
        cases.append(("log-normal", L, [min(L, int(rng.lognormvariate(5.5, 0.9)) + 1) for _ in range(n)]))
    rng = random.Random(2)
    cases += [("uniform 1..L", 4096, [rng.randint(1, 4096) for _ in range(n)]),
              ("uniform L/4..L/2", 4096, [rng.randint(1024, 2048) for _ in range(n)]),
              ("all L/2 + 1", 4096, [2049] * n)]
    for name, L, costs in cases:
        rows, secs = {}, {}
        for algorithm in ("best-fit-decreasing", "bfd-local-search"):
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                rows[algorithm] = len(pack(costs, L, algorithm))
                best = min(best, time.perf_counter() - t0)
            secs[algorithm] = best * 100_000 / n
        print(f"{name:<22} {L:>5} {lower_bound_rows(costs, L):>6} {rows['best-fit-decreasing']:>8} "
              f"{rows['bfd-local-search']:>8} {secs['best-fit-decreasing']:>10.3f} {secs['bfd-local-search']:>10.3f}")


def file_lengths(path: Path, tokenizer: str, tok, fmt, cache: str) -> list[int]:
    """Token count of each conversation of ``path`` (full rendering, one raw encode), from ``cache`` when there."""
    key = hashlib.sha256(path.read_bytes()).hexdigest()[:16] + "-" + tokenizer_fingerprint(tok) + "-" + \
        hashlib.sha256((fmt.chat_template or "").encode()).hexdigest()[:16]
    cached = Path(cache) / f"{path.stem}.{key}.json" if cache else None
    if cached is not None and cached.is_file():
        return json.loads(cached.read_text())
    lengths, _ = raw_encode(render_file(path, tok, fmt), tokenizer, 1)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cached, lengths)
    return lengths


def time_packer(inputs: list[str], tokenizer: str, processes: int, max_seq_len: int, out_dir: str):
    """Run the packer once; return its report and wall seconds."""
    cfg = PackConfig(inputs=inputs, output=os.path.join(out_dir, f"rows.p{processes}.jsonl.packed"),
                     tokenizer=tokenizer, max_seq_len=max_seq_len, num_workers=0 if processes == 1 else processes,
                     histogram="", progress=False)
    t0 = time.perf_counter()
    report = run_pack(cfg)
    return report, time.perf_counter() - t0


def main(argv=None) -> int:
    """Run the benchmark; return the exit code (1 when a count disagrees or an algorithm is worse than BFD)."""
    tokenizers = SHARED_DATA / "tokenizers"
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(SHARED_DATA / "chat"), help="folder of *.jsonl chat files, or one file")
    p.add_argument("--tokenizers", nargs="+", default=[str(tokenizers / "smollm2-135m-instruct"),
                                                       str(tokenizers / "qwen2.5")],
                   help="tokenizer folders (their chat templates); the throughput runs use the first")
    p.add_argument("--max-seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--context-parallel-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cache", default=str(REPO_ROOT / "out" / "bench" / "pack_lengths"),
                   help="folder for the token counts per file and tokenizer ('' for none)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="process counts for the throughput runs")
    p.add_argument("--throughput-max-seq-len", type=int, default=4096)
    p.add_argument("--throughput-limit", type=int, default=5000, help="conversations per file in the throughput runs")
    p.add_argument("--efficiency-only", action="store_true")
    a = p.parse_args(argv)
    data = Path(a.data)
    files = sorted(data.glob("*.jsonl")) if data.is_dir() else [data]
    if not files:
        print(f"error: no *.jsonl in {data}", file=sys.stderr)
        return 2
    print(f"{len(files)} files in {data}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    lengths_by_tok = {}
    for tokenizer in a.tokenizers:
        tok = load_tokenizer(tokenizer)
        fmt = get_prompt_format("chat-template", tok)
        t0 = time.perf_counter()
        by_name = {f.name: file_lengths(f, tokenizer, tok, fmt, a.cache) for f in files}
        by_name["all files"] = [n for v in by_name.values() for n in v]
        lengths_by_tok[Path(tokenizer).name] = by_name
        print(f"{Path(tokenizer).name}: {len(by_name['all files'])} conversations counted in "
              f"{time.perf_counter() - t0:.1f} s (one template call and one encode each, or the cache)")
    worse = print_efficiency(lengths_by_tok, a.max_seq_lens, a.context_parallel_sizes)
    print_synthetic_speed(a.max_seq_lens)
    if a.efficiency_only:
        return 1 if worse else 0
    tok = load_tokenizer(a.tokenizers[0])
    a.tokenizer = a.tokenizers[0]
    return max(1 if worse else 0, print_throughput(a, files, tok, get_prompt_format("chat-template", tok)))


def head_file(path: Path, limit: int, out_dir: str) -> Path:
    """Copy of the first ``limit`` lines of ``path`` in ``out_dir`` (the whole file when it is shorter)."""
    dst = Path(out_dir) / path.name
    with open(path, encoding="utf-8") as src, open(dst, "w", encoding="utf-8") as out:
        for _, line in zip(range(limit), src):
            out.write(line)
    return dst


def print_throughput(a, files: list[Path], tok, fmt) -> int:
    """Time the packer and the raw encode per file and process count; print conversations/s and the ratios."""
    L, mismatches = a.throughput_max_seq_len, 0
    print(f"\nthroughput: first {a.throughput_limit} conversations of each file, L={L}, {DEFAULT_ALGORITHM}, "
          f"wall seconds (load average {os.getloadavg()[0]:.1f}); 'start s' = the packer on one conversation "
          f"(tokenizer load, process start, writing); 'steady' = raw / (packer - start), "
          f"shown when the start is under half the packer's time")
    print(f"{'input':<42} {'convs':>5} {'msgs/conv':>9} {'procs':>5} {'raw s':>7} {'raw conv/s':>10} {'packer s':>8} "
          f"{'packer conv/s':>13} {'start s':>7} {'packer/raw':>10} {'steady':>7}")
    with tempfile.TemporaryDirectory() as out_dir:
        one = head_file(files[0], 1, tempfile.mkdtemp(dir=out_dir))
        for f in files:
            part = head_file(f, a.throughput_limit, out_dir)
            texts = render_file(part, tok, fmt)
            with open(part, encoding="utf-8") as fh:
                msgs = sum(len(json.loads(x)["messages"]) for x in fh) / len(texts)
            for procs in a.workers:
                lengths, raw_s = raw_encode(texts, a.tokenizer, procs)
                report, pack_s = time_packer([str(part)], a.tokenizer, procs, L, out_dir)
                start_s = time_packer([str(one)], a.tokenizer, procs, L, out_dir)[1]
                expected = len(pack(costs_of(lengths, L, 1), L, DEFAULT_ALGORITHM))
                same = report.real_tokens == sum(min(x, L) for x in lengths) and report.rows == expected
                mismatches += not same
                n = len(texts)
                steady = f"{raw_s / (pack_s - start_s):.4f}" if pack_s > 2 * start_s else "n/a"
                print(f"{f.name:<42} {n:>5} {msgs:>9.1f} {procs:>5} {raw_s:>7.2f} {n / raw_s:>10.0f} {pack_s:>8.2f} "
                      f"{n / pack_s:>13.1f} {start_s:>7.2f} {raw_s / pack_s:>10.4f} {steady:>7}"
                      + ("" if same else "  MISMATCH: packer counts differ from the raw encode"))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())

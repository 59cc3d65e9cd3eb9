#!/usr/bin/env python
"""Packing benchmark: efficiency of each algorithm, and packer throughput against the raw tokenizer.

    python bench/pack.py                                   # all ../shared/data/chat/*.jsonl, SmolLM2 template
    python bench/pack.py --data path/to/chat --tokenizer path/to/tok --max-seq-lens 4096 --workers 1 2
    python bench/pack.py --efficiency-only                 # skip the (slow) packer runs

Efficiency (``docs/packing.md``): for every input file and for all files together, at each ``max_seq_len`` L, each
algorithm's rows, efficiency = real tokens / (rows * L) and rows over the lower bound
``ceil(sum(cost) / L)`` per 1,000 rows. Token counts come from one raw encode of each conversation's full
chat-template rendering (the packer counts exactly these tokens: checked against the packer's report
below); rows come from :func:`packsft.packing.algorithms.pack` with the pipeline's oversize rule (``own-row``:
an oversize conversation fills a row by itself).

Throughput, per file (its first ``--throughput-limit`` conversations), with P processes: the packer is
:func:`packsft.packing.pipeline.run_pack` end to end (read, parse, render, tokenize with masking checks,
pack, write rows + sidecar + report; no histogram; tokenizer load and process start included) with
``num_workers=0`` for P=1 and ``num_workers=P`` otherwise; the raw baseline is
``tokenizer.backend_tokenizer.encode_batch`` of the same rendered texts in P processes (batches of 64,
``TOKENIZERS_PARALLELISM=false``; pool started and tokenizers loaded before timing). Both are in
conversations/s, with their ratio. Wall-clock times: on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as in the packer's workers

from packsft.conversation import parse_record  # noqa: E402
from packsft.layout import conversation_cost  # noqa: E402
from packsft.packing.algorithms import ALGORITHMS, lower_bound_rows, pack  # noqa: E402
from packsft.packing.pipeline import PackConfig, run_pack  # noqa: E402
from packsft.prompt_formats import get_prompt_format  # noqa: E402
from packsft.tokenizer import load_tokenizer  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
BATCH = 64


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


def efficiency_rows(lengths: list[int], max_seq_len: int) -> dict[str, dict]:
    """Rows, efficiency and rows over the lower bound of each algorithm for conversations of ``lengths`` tokens."""
    costs = [min(conversation_cost(n), max_seq_len) for n in lengths]  # own-row oversize policy, CP 1
    real = sum(min(n, max_seq_len) for n in lengths)
    bound = lower_bound_rows(costs, max_seq_len)
    out = {}
    for algorithm in ALGORITHMS:
        rows = len(pack(costs, max_seq_len, algorithm))
        out[algorithm] = {"rows": rows, "lower_bound": bound, "efficiency": real / (rows * max_seq_len),
                          "over_per_1000": 1000 * (rows - bound) / rows,
                          "oversize": sum(n > max_seq_len for n in lengths)}
    return out


def print_efficiency(lengths_by_name: dict[str, list[int]], max_seq_lens: list[int]) -> None:
    """Print the efficiency table (one line per input and L; both algorithms side by side).

    ``bound eff %`` is the efficiency of a packing with exactly the lower bound of rows: no algorithm does better.
    """
    nf, bfd = ALGORITHMS
    print(f"\n{'input':<42} {'L':>5} {'convs':>6} {'oversize':>8} {'bound':>6} {'bound eff %':>11} | "
          f"{nf + ' rows':>14} {'eff %':>7} {'over/1k':>7} | {bfd + ' rows':>24} {'eff %':>7} {'over/1k':>7}")
    for L in max_seq_lens:
        for name, lengths in lengths_by_name.items():
            r = efficiency_rows(lengths, L)
            bound_eff = r[nf]["efficiency"] * r[nf]["rows"] / r[nf]["lower_bound"]
            print(f"{name:<42} {L:>5} {len(lengths):>6} {r[nf]['oversize']:>8} {r[nf]['lower_bound']:>6} "
                  f"{100 * bound_eff:>11.2f} | "
                  f"{r[nf]['rows']:>14} {100 * r[nf]['efficiency']:>7.2f} {r[nf]['over_per_1000']:>7.2f} | "
                  f"{r[bfd]['rows']:>24} {100 * r[bfd]['efficiency']:>7.2f} {r[bfd]['over_per_1000']:>7.2f}")


def time_packer(inputs: list[str], tokenizer: str, processes: int, max_seq_len: int, out_dir: str):
    """Run the packer once; return its report and wall seconds."""
    cfg = PackConfig(inputs=inputs, output=os.path.join(out_dir, f"rows.p{processes}.jsonl.packed"),
                     tokenizer=tokenizer, max_seq_len=max_seq_len, num_workers=0 if processes == 1 else processes,
                     histogram="", progress=False)
    t0 = time.perf_counter()
    report = run_pack(cfg)
    return report, time.perf_counter() - t0


def main(argv=None) -> int:
    """Run the benchmark; return the exit code (1 when the packer's counts disagree with the raw encode)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(SHARED_DATA / "chat"), help="folder of *.jsonl chat files, or one file")
    p.add_argument("--tokenizer", default=str(SHARED_DATA / "tokenizers" / "smollm2-135m-instruct"))
    p.add_argument("--max-seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
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
    tok = load_tokenizer(a.tokenizer)
    fmt = get_prompt_format("chat-template", tok)
    t0 = time.perf_counter()
    texts_by_file = {f.name: render_file(f, tok, fmt) for f in files}
    texts = [t for ts in texts_by_file.values() for t in ts]
    print(f"{len(texts)} conversations in {len(files)} files, rendered once (one template call each) in "
          f"{time.perf_counter() - t0:.1f} s; tokenizer {a.tokenizer}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    lengths, _ = raw_encode(texts, a.tokenizer, 1)
    lengths_by_name, i = {}, 0
    for name, ts in texts_by_file.items():
        lengths_by_name[name], i = lengths[i : i + len(ts)], i + len(ts)
    lengths_by_name["all files"] = lengths
    print_efficiency(lengths_by_name, a.max_seq_lens)
    if a.efficiency_only:
        return 0
    return print_throughput(a, files, tok, fmt)


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
    print(f"\nthroughput: first {a.throughput_limit} conversations of each file, L={L}, best-fit-decreasing, "
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
                expected = efficiency_rows(lengths, L)["best-fit-decreasing"]["rows"]
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

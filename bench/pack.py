#!/usr/bin/env python
"""Packing benchmark: rows of each algorithm against the lower bound, and packer throughput against the tokenizer's.

    python bench/pack.py                                   # all ../shared/data/chat/*.jsonl, SmolLM2 + Qwen2.5
    python bench/pack.py --data path/to/chat --tokenizers path/to/tok --max-seq-lens 4096 --workers 1 2
    python bench/pack.py --efficiency-only                 # skip the (slow) packer runs
    python bench/pack.py --instructions 100 300            # instruction counts (valgrind), not seconds

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
checks, pack, write rows + sidecar + token cache + report; no histogram; tokenizer load and worker start
included) with
``num_workers=0`` for P=1 and ``num_workers=P`` otherwise; the baseline is batched
``tokenizer.apply_chat_template(conversations, tokenize=True)`` (batches of 64, the parsed conversations, in
P processes; ``TOKENIZERS_PARALLELISM=false``; pool started and tokenizers loaded before timing; one
``load_tokenizer`` is timed apart, ``load s``). Every timed run is a fresh Python process (as a user's run
is; the imports, and the baseline's JSON parsing, before its clock: run in one process after each other, each
side was 10-15 % slower after the other's run). Each is run ``--repeat`` times (default 3), alternating, and
its fastest run is shown. Both in conversations/s, with their ratio by wall time (``wall ratio``; ``e2e
ratio`` charges the baseline its tokenizer load too, as the packer is) and by CPU time (all processes), the
median end-to-end ratio of the back-to-back pairs (``e2e paired``: the machine's speed drifts over minutes,
and a pair shares it) and, with P > 1, the speed-up over the packer's own 1-process run (``x1``: of the
fastest runs, and the median over the repeats, each of which runs every process count in turn). With
several files, all of them together are one more case (one packer run over all the inputs).

``--instructions N1 N2``: instead, instructions counted by valgrind's callgrind (which do not drift with the
machine's speed) of the packer (``run_pack``) and of the baseline (its tokenizer load and the batched
template calls), one process, on the first N1 and N2 conversations of each file; printed as a fixed part and
a part per conversation, and the baseline / packer ratio extrapolated to the whole file.

``--scale N`` (default 1M): a synthetic file of N conversations (seeded random words; by default 2 messages of
3-40 words, ``--scale-words``) is packed by the CLI in a child process (``--num-workers`` from
``--scale-workers``, default 0) at N/4 and N; the peak RSS of all its processes (sampled with psutil every
50 ms, summed over the process tree), and its anonymous part (less file-backed pages), are printed with a linear
extrapolation to 10M conversations.

Exit code 1 when an algorithm uses more rows than best-fit decreasing or the packer's counts disagree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as in the packer's workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packsft, as tools/ does

from packsft.conversation import parse_record  # noqa: E402
from packsft.io import write_json_atomic  # noqa: E402
from packsft.jsonl import ConversationError, iter_jsonl_lines, loads_line  # noqa: E402
from packsft.layout import conversation_cost  # noqa: E402
from packsft.packing.algorithms import DEFAULT_ALGORITHM, lower_bound_rows, pack  # noqa: E402
from packsft.packing.config import PackConfig  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.prompt_formats import get_prompt_format  # noqa: E402
from packsft.prompt_formats.chat_template import _template_messages  # noqa: E402
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
    return [tok.apply_chat_template(conv.messages, tools=conv.tools, chat_template=fmt.chat_template, tokenize=False)
            for conv in _records(path)]


class BenchInputError(ValueError):
    """A line of a benchmark input the bench cannot use (``file:line: reason``): it compares counts with the
    packer's, so every line must be a valid conversation."""


def _records(path: Path):
    """The conversations of JSONL ``path``, read as the packer reads it (a byte order mark and blank lines
    skipped).

    Raises:
        BenchInputError: a line that is not UTF-8, not JSON or not a valid record.
    """
    for line, text, error in iter_jsonl_lines(path):
        try:
            yield parse_record(loads_line(text, path, line, error), path, line)
        except ConversationError as e:
            raise BenchInputError(str(e)) from e


_TOK: dict = {}


def _init_encoder(tokenizer: str) -> None:
    _TOK["tok"] = load_tokenizer(tokenizer)


def _template_batch(batch: list[tuple[list[dict], list | None]]) -> list[int]:
    """Token counts of ``apply_chat_template(tokenize=True)`` over a batch of ``(messages, tools)``."""
    tok = _TOK["tok"]
    if all(tools is None for _, tools in batch):
        ids = tok.apply_chat_template([m for m, _ in batch], tokenize=True, return_dict=False)
        return [len(x) for x in ids]
    return [len(tok.apply_chat_template(m, tools=t, tokenize=True, return_dict=False)) for m, t in batch]


def _batches(convs: list) -> list[list]:
    """The baseline's batches of :data:`BATCH` conversations."""
    return [convs[i : i + BATCH] for i in range(0, len(convs), BATCH)]


def _cpu() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def template_baseline(convs: list[tuple[list[dict], list | None]], tokenizer: str, processes: int):
    """Token counts, wall seconds and CPU seconds of batched ``apply_chat_template(tokenize=True)``, and the
    wall seconds of one ``load_tokenizer`` (not in the others).

    With ``processes > 1`` the pool is started and its tokenizers loaded before the clocks start, its CPU time
    is what its batches took (``time.process_time`` in each), and the load is timed once in this process (the
    pool's load theirs in parallel).
    """
    batches = _batches(convs)
    t0 = time.perf_counter()
    _init_encoder(tokenizer)
    load_s = time.perf_counter() - t0
    if processes == 1:
        t0, c0 = time.perf_counter(), _cpu()
        out = [_template_batch(b) for b in batches]
        return [n for b in out for n in b], time.perf_counter() - t0, _cpu() - c0, load_s
    pool = mp.get_context("spawn").Pool(processes, initializer=_init_encoder, initargs=(tokenizer,))
    pool.map(_template_batch, [[([{"role": "user", "content": "warm-up"}], None)]] * processes, chunksize=1)
    t0, c0 = time.perf_counter(), time.process_time()
    out = pool.map(_cpu_timed_batch, batches, chunksize=1)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0 + sum(c for _, c in out)
    pool.close()
    pool.join()
    return [n for b, _ in out for n in b], elapsed, cpu, load_s


def _cpu_timed_batch(batch: list[tuple[list[dict], list | None]]) -> tuple[list[int], float]:
    """:func:`_template_batch` and the CPU seconds it took in this (pool) process."""
    c0 = time.process_time()
    return _template_batch(batch), time.process_time() - c0


def _encode_lengths(texts: list[str]) -> list[int]:
    return [len(e.ids) for e in _TOK["tok"].backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def raw_encode(texts: list[str], tokenizer: str) -> list[int]:
    """Token count of each text (one process; for the efficiency tables)."""
    _init_encoder(tokenizer)
    return [n for i in range(0, len(texts), BATCH) for n in _encode_lengths(texts[i : i + BATCH])]


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
    lengths = raw_encode(render_file(path, tok, fmt), tokenizer)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cached, lengths)
    return lengths


def time_packer(inputs: list[str], tokenizer: str, processes: int, max_seq_len: int, out_dir: str):
    """Run the packer once; return its report, wall seconds and CPU seconds (its workers included)."""
    cfg = PackConfig(inputs=inputs, output=os.path.join(out_dir, f"rows.p{processes}.jsonl.packed"),
                     tokenizer=tokenizer, max_seq_len=max_seq_len, num_workers=0 if processes == 1 else processes,
                     histogram="", progress=False)
    t0, c0 = time.perf_counter(), _cpu()
    report = run_pack(cfg)
    return report, time.perf_counter() - t0, _cpu() - c0


def throughput_child(a, side: str, procs: str, out_dir: str, *inputs: str) -> int:
    """One timed run in a fresh process (what a user's run is; a run after the other side's in the same
    process was 10-15 % slower): print its JSON on stdout. The imports, and the baseline's parsing, are done
    before the clock starts."""
    if side == "baseline":
        convs = [c for path in inputs for c in _parsed(Path(path))]
        lengths, wall, cpu, load = template_baseline(convs, a.tokenizer, int(procs))
        out = {"lengths": lengths, "wall": wall, "cpu": cpu, "load": load}
    else:
        report, wall, cpu = time_packer(list(inputs), a.tokenizer, int(procs), a.throughput_max_seq_len, out_dir)
        out = {"rows": report.rows, "real_tokens": report.real_tokens, "wall": wall, "cpu": cpu}
    print(json.dumps(out))
    return 0


def _self_command(a, *args: str) -> list[str]:
    """This script, run by this Python with the run's tokenizer and ``L``, and ``args`` (a hidden child mode)."""
    return [sys.executable, __file__, "--tokenizers", a.tokenizer, "--throughput-max-seq-len",
            str(a.throughput_max_seq_len), *args]


def _in_child(a, side: str, procs: int, inputs: list[Path], out_dir: str) -> dict:
    """:func:`throughput_child` in a new Python process; its JSON."""
    import subprocess

    cmd = _self_command(a, "--throughput-child", side, str(procs), out_dir, *map(str, inputs))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    p.add_argument("--repeat", type=int, default=3,
                   help="throughput runs of the baseline and the packer, alternated; the fastest of each is shown")
    p.add_argument("--efficiency-only", action="store_true")
    p.add_argument("--instructions", type=int, nargs=2, metavar=("N1", "N2"), default=None,
                   help="only the instruction counts (valgrind callgrind): the packer and the baseline, each with "
                        "its tokenizer load, on the first N1 and N2 conversations of each file")
    p.add_argument("--instructions-child", nargs=3, metavar=("SIDE", "FILE", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--throughput-child", nargs="+", metavar="SIDE PROCS OUT FILE", help=argparse.SUPPRESS)
    p.add_argument("--scale", type=int, nargs="?", const=1_000_000, default=None,
                   help="only the memory run: pack N/4 and N synthetic conversations (default N 1M), peak RSS")
    p.add_argument("--scale-workers", type=int, default=0, help="--num-workers of the --scale runs")
    p.add_argument("--scale-words", type=int, default=40,
                   help="longest message of the --scale conversations in words (below 60: 2 messages each; what "
                        "the packer keeps per conversation does not depend on its length, and short ones make "
                        "1M conversations a few minutes)")
    a = p.parse_args(argv)
    a.tokenizer = a.tokenizers[0]
    if a.scale is not None:
        return print_scale(a)
    if a.instructions_child:
        return instructions_child(a, *a.instructions_child)
    if a.throughput_child:
        return throughput_child(a, *a.throughput_child)
    data = Path(a.data)
    if not data.exists():
        print(f"error: --data {data}: no such file or folder", file=sys.stderr)
        return 2
    for flag, values in (("--workers", a.workers), ("--repeat", [a.repeat]),
                         ("--throughput-limit", [a.throughput_limit])):
        if min(values) < 1:
            print(f"error: {flag} must be at least 1, got {min(values)}", file=sys.stderr)
            return 2
    if a.instructions and a.instructions[0] == a.instructions[1]:
        print(f"error: --instructions needs two different sizes, got {a.instructions[0]} twice", file=sys.stderr)
        return 2
    files = sorted(data.glob("*.jsonl")) if data.is_dir() else [data]
    if not files:
        print(f"error: no *.jsonl in {data}", file=sys.stderr)
        return 2
    if a.instructions:
        return print_instructions(a, files)
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


def _parsed(path: Path) -> list[tuple[list[dict], list | None]]:
    return [(_template_messages(c.messages), c.tools) for c in _records(path)]


def print_throughput(a, files: list[Path], tok, fmt) -> int:
    """Time the packer and the batched template baseline per file (and all files together, in one run) and
    process count; print conv/s and ratios."""
    L, mismatches = a.throughput_max_seq_len, 0
    print(f"\nthroughput: first {a.throughput_limit} conversations of each file, L={L}, {DEFAULT_ALGORITHM} "
          f"(load average {os.getloadavg()[0]:.1f}), fastest of {a.repeat} alternated runs each; "
          "baseline = batched apply_chat_template(tokenize=True) (its tokenizer loaded before its clock); "
          "'load s' = one load_tokenizer, which the packer's time includes; "
          "'wall ratio' = baseline / packer, 'e2e ratio' = (load + baseline) / packer, by wall time; "
          "'start s' = the packer on one conversation (tokenizer load, writing); "
          "'steady' = baseline / (packer - start), shown when the start is under half the packer's; "
          "'e2e paired' = median over the runs of (load + baseline) / packer, each pair run back to back; "
          "'x1' = the packer's 1-process wall time / this one's, fastest runs (median of the runs paired "
          "within a repeat)")
    print(f"{'input':<34} {'convs':>6} {'msgs':>5} {'procs':>5} {'base s':>7} {'load s':>6} {'base cpu':>8} "
          f"{'packer s':>8} {'pack cpu':>8} {'pack conv/s':>11} {'start s':>7} {'wall ratio':>10} "
          f"{'e2e ratio':>9} {'cpu ratio':>9} {'steady':>7} {'e2e paired':>10} {'x1 (paired)':>11}")
    with tempfile.TemporaryDirectory() as out_dir:
        one = head_file(files[0], 1, tempfile.mkdtemp(dir=out_dir))
        parts = [head_file(f, a.throughput_limit, out_dir) for f in files]
        cases = [(f.name, [part]) for f, part in zip(files, parts)]
        if len(files) > 1:
            cases.append(("all files (one run)", parts))
        for name, inputs in cases:
            convs = [c for part in inputs for c in _parsed(part)]
            msgs = sum(len(m) for m, _ in convs) / len(convs)
            best: dict[int, list] = {procs: [None, None, []] for procs in a.workers}  # baseline, packer, pairs
            pack_runs: dict[int, list[float]] = {procs: [] for procs in a.workers}
            for _ in range(a.repeat):  # alternated, the fastest of each: a shared machine's noise is one-sided
                for procs in a.workers:  # each process count in turn within a repeat, so x1 can be paired too
                    kept = best[procs]
                    got = _in_child(a, "baseline", procs, inputs, out_dir)
                    kept[0] = got if kept[0] is None or got["wall"] < kept[0]["wall"] else kept[0]
                    pair = got["load"] + got["wall"]  # e2e: with its tokenizer load, as the packer's
                    got = _in_child(a, "packer", procs, inputs, out_dir)
                    kept[1] = got if kept[1] is None or got["wall"] < kept[1]["wall"] else kept[1]
                    kept[2].append(pair / got["wall"])
                    pack_runs[procs].append(got["wall"])
            for procs in a.workers:
                base, packed, pairs = best[procs]
                lengths, base_s, base_cpu, load_s = base["lengths"], base["wall"], base["cpu"], base["load"]
                pack_s, pack_cpu = packed["wall"], packed["cpu"]
                start_s = min(_in_child(a, "packer", procs, [one], out_dir)["wall"] for _ in range(a.repeat))
                expected = len(pack(costs_of(lengths, L, 1), L, DEFAULT_ALGORITHM))
                same = packed["real_tokens"] == sum(min(x, L) for x in lengths) and packed["rows"] == expected
                mismatches += not same
                n = len(convs)
                steady = f"{base_s / (pack_s - start_s):.3f}" if pack_s > 2 * start_s else "n/a"
                x1 = ""
                if procs > 1 and 1 in pack_runs:
                    x1 = (f"{min(pack_runs[1]) / pack_s:.2f} "
                          f"({statistics.median(o / t for o, t in zip(pack_runs[1], pack_runs[procs])):.2f})")
                print(f"{name[:34]:<34} {n:>6} {msgs:>5.1f} {procs:>5} {base_s:>7.2f} {load_s:>6.2f} {base_cpu:>8.2f} "
                      f"{pack_s:>8.2f} {pack_cpu:>8.2f} {n / pack_s:>11.1f} {start_s:>7.2f} {base_s / pack_s:>10.3f} "
                      f"{(load_s + base_s) / pack_s:>9.3f} {base_cpu / pack_cpu:>9.3f} {steady:>7} "
                      f"{statistics.median(pairs):>10.3f} {x1:>11}"
                      + ("" if same else "  MISMATCH: packer counts differ from apply_chat_template's"))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 1 if mismatches else 0


def instructions_child(a, side: str, path: str, out_dir: str) -> int:
    """The measured work of one ``--instructions`` run, inside ``functools.reduce`` (the C function callgrind
    collects in): ``baseline`` = ``load_tokenizer`` + the batched template calls over the parsed
    conversations (parsed before), ``packer`` = ``run_pack`` (its load inside)."""
    import functools

    if side == "baseline":
        convs = _parsed(Path(path))
        batches = _batches(convs)

        def work():
            _init_encoder(a.tokenizer)
            return [_template_batch(b) for b in batches]
    else:
        cfg = PackConfig(inputs=[path], output=os.path.join(out_dir, "rows.jsonl.packed"), tokenizer=a.tokenizer,
                         max_seq_len=a.throughput_max_seq_len, histogram="", progress=False)

        def work():
            return run_pack(cfg)
    functools.reduce(lambda _, f: f(), [work], None)
    return 0


def _callgrind(a, side: str, path: Path, out_dir: str) -> int:
    """Instructions executed inside :func:`instructions_child`'s ``functools.reduce`` (valgrind callgrind)."""
    import subprocess

    out = os.path.join(out_dir, f"callgrind.{side}.out")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--toggle-collect=functools_reduce",
           *_self_command(a, "--instructions-child", side, str(path), out_dir)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def print_instructions(a, files: list[Path]) -> int:
    """Instruction counts of the packer and the baseline at two sizes per file: the fixed part, the part per
    conversation (their difference over N2 - N1) and the ratio extrapolated to the whole file (one process)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    if shutil.which("valgrind") is None:
        print("error: --instructions needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    n1, n2 = sorted(a.instructions)
    print(f"instructions (valgrind callgrind), first {n1} and {n2} conversations of each file, L="
          f"{a.throughput_max_seq_len}, one process, each side with its tokenizer load; 'per conv' = the increase "
          f"per conversation from {n1} to {n2}; 'fixed' = the rest; 'whole file' = baseline / packer "
          "instructions extrapolated to all the file's conversations")
    print(f"{'input':<34} {'convs':>6} {'base fixed G':>12} {'base per conv M':>15} {'pack fixed G':>12} "
          f"{'pack per conv M':>15} {'per conv ratio':>14} {'whole file ratio':>16}")
    def count(f: Path, side: str, n: int) -> int:
        with tempfile.TemporaryDirectory() as out_dir:
            return _callgrind(a, side, head_file(f, n, out_dir), out_dir)

    pool = ThreadPoolExecutor(os.cpu_count() or 1)  # the counts do not depend on what else runs
    for f in files:
        with open(f, encoding="utf-8") as src:
            blank = [not line.strip() for line in src]
        lines, total = len(blank), len(blank) - sum(blank)
        if lines < n2:  # head_file would give fewer lines than the fit divides by
            print(f"{f.name[:34]:<34} skipped: {lines} lines, fewer than N2 = {n2}", flush=True)
            continue
        runs = {(side, n): pool.submit(count, f, side, n) for side in ("baseline", "packer") for n in (n1, n2)}
        fit = {}
        for side in ("baseline", "packer"):
            c1, c2 = runs[side, n1].result(), runs[side, n2].result()
            per = (c2 - c1) / (n2 - n1)
            fit[side] = (c1 - per * n1, per)
        (bf, bp), (pf, pp) = fit["baseline"], fit["packer"]
        whole = (bf + bp * total) / (pf + pp * total)
        print(f"{f.name[:34]:<34} {total:>6} {bf / 1e9:>12.3f} {bp / 1e6:>15.2f} {pf / 1e9:>12.3f} "
              f"{pp / 1e6:>15.2f} {bp / pp:>14.3f} {whole:>16.3f}", flush=True)
    pool.shutdown()
    return 0


_WORDS = ("the of and to in is that it for on with as was at by an be this from or which one had not but what all "
          "were when we there can more if out so said up its about into than them only two other time new some "
          "could these may then do first any my now such like our over man me even most made after also did many "
          "before must through back years where much your way well down should because each just those people "
          "how too little state good very make world still own see men work long get here between both life "
          "being under never day same another know while last might us great old year off come since against go "
          "came right used take three").split()


def synthetic_file(path: Path, n: int, seed: int = 0, max_words: int = 300) -> Path:
    """``n`` conversations of seeded random words (2-6 messages; user turns 5-60 words, assistant turns 5 to
    ``max_words``; with ``max_words`` < 60, 2 messages of 3 to ``max_words`` words) as messages JSONL."""
    import random

    rng = random.Random(seed)
    short = max_words < 60
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            msgs = []
            for t in range(2 if short else rng.choice((2, 2, 2, 4, 6))):
                k = rng.randint(3, max_words) if short else rng.randint(5, 60 if t % 2 == 0 else max_words)
                words = rng.choices(_WORDS, k=k)
                msgs.append({"role": "user" if t % 2 == 0 else "assistant", "content": " ".join(words)})
            f.write(json.dumps({"id": i, "messages": msgs}) + "\n")
    return path


def peak_rss(argv: list[str]) -> tuple[int, float, int, int]:
    """Run ``argv``; return its exit code, wall seconds, and the peak RSS and peak anonymous RSS (RSS less its
    file-backed and shared pages: psutil's ``rss - shared``) in bytes of its process tree (summed)."""
    import subprocess
    import threading

    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    top = psutil.Process(proc.pid)
    peak = [0, 0]

    def sample():
        while proc.poll() is None:
            try:
                infos = [p.memory_info() for p in (top, *top.children(recursive=True))]
            except psutil.Error:
                infos = []
            peak[0] = max(peak[0], sum(i.rss for i in infos))
            peak[1] = max(peak[1], sum(i.rss - i.shared for i in infos))
            time.sleep(0.05)

    thread = threading.Thread(target=sample)
    thread.start()
    code = proc.wait()
    thread.join()
    return code, time.perf_counter() - t0, peak[0], peak[1]


def print_scale(a) -> int:
    """Pack synthetic files of N/4 and N conversations; print peak RSS and its extrapolation to 10M."""
    print(f"\nscale: synthetic conversations, {a.tokenizer}, L=4096, --num-workers {a.scale_workers} "
          f"(load average {os.getloadavg()[0]:.1f})")
    print(f"{'conversations':>13} {'input MB':>8} {'wall s':>7} {'conv/s':>7} {'peak RSS MB':>11} {'anon MB':>8}")
    points = []
    with tempfile.TemporaryDirectory() as d:
        for n in (max(1, a.scale // 4), a.scale):
            src = synthetic_file(Path(d) / f"synthetic{n}.jsonl", n, max_words=a.scale_words)
            argv = [sys.executable, str(REPO_ROOT / "tools" / "pack_megatron_sft_jsonl.py"), "--input", str(src),
                    "--output", str(Path(d) / f"out{n}" / "rows.jsonl.packed"), "--tokenizer", a.tokenizer,
                    "--max-seq-length", "4096", "--num-workers", str(a.scale_workers), "--no-progress"]
            code, wall, peak, anon = peak_rss(argv)
            if code != 0:
                print(f"error: the packer exited {code} on {n} conversations", file=sys.stderr)
                return 1
            points.append((n, peak, anon))
            print(f"{n:>13} {src.stat().st_size / 1e6:>8.1f} {wall:>7.1f} {n / wall:>7.0f} {peak / 2**20:>11.0f} "
                  f"{anon / 2**20:>8.0f}")
            Path(src).unlink()
    (n0, r0, a0), (n1, r1, a1) = points
    for name, lo, hi in (("RSS", r0, r1), ("anonymous RSS", a0, a1)):
        per = (hi - lo) / (n1 - n0) if n1 > n0 else 0.0
        print(f"{name}: {per:.0f} B per conversation; extrapolated peak at 10M conversations: "
              f"{(hi + per * (10_000_000 - n1)) / 2**30:.2f} GiB (target < 2 GB)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

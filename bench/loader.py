#!/usr/bin/env python
"""Loader benchmark: rows/s and tokens/s that ONE CPU worker builds from real packed data, against a GPU's appetite,
with the packer's token cache and re-tokenizing.

    python bench/loader.py                                    # 4K and 8K, nemotron-nano-v2 and chat-template
    python bench/loader.py --max-seq-lens 8192 --rows 100 --cached-rows 2000 --conversations 6000

Setup: the first ``--conversations`` conversations of a mix of the shared chat files (gsm8k train, hh-rlhf,
gpteacher, chitchat: short math, multi-turn, long-tail chats) are packed with the real packer
(:func:`packsft.packing.pipeline.run_pack`, best-fit decreasing, cp=1) for each ``max_seq_len`` and prompt
format, into a temporary folder. Packing is not timed.

Measured: one worker is this process with one torch thread and ``TOKENIZERS_PARALLELISM=false`` (as in a
``DataLoader`` worker): ``PackedSFTDataset.__getitem__`` in a seeded random order, after one warm-up row, on two
datasets over the same file: *re-tokenizing* (``use_token_cache=False``, ``--rows`` rows) and *cached*
(the token cache the packer wrote beside the rows, ``--cached-rows`` rows, drawn with replacement). Reported
per path: rows/s; real tokens/s (conversation tokens) and row tokens/s (``max_seq_len`` per row); the cached
path's speed-up over re-tokenizing (same run); the time split between reading+parsing+splitting the row,
tokenizing (render, encode, masking checks) and building the tensors (:func:`packsft.data.row.build_row`), and
for the cached path between reading the cache (:meth:`packsft.token_cache.TokenCache.row`) and
:func:`packsft.data.row.build_row_flat` (``build_row``'s core, fed by the cache directly).
The issue's target: >= 1000 rows/s per worker at 8K with the cache.

GPU consumption (an assumption, not a measurement): the brief's 1 row/s per GPU for a 1B-parameter model at
8K tokens, and, for comparison, a FLOP estimate ``6 * N * L + 6 * n_layers * L^2 * d_model`` (causal attention
halves the ``12 * ...`` term) at 40 % MFU of an H100's 989 dense bf16 TFLOP/s, with N = 1.24e9, 16 layers,
d_model 2048 (Llama-3.2-1B). The target is ``worker rows/s >= 20 * GPU rows/s`` at 8K. Wall-clock times on a
shared machine are noisy: rerun before trusting a small difference.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402

from packsft.conversation import split_row  # noqa: E402
from packsft.data.dataset import PackedSFTDataset  # noqa: E402
from packsft.data.row import build_row, build_row_flat  # noqa: E402
from packsft.packing.config import PackConfig  # noqa: E402
from packsft.packing.pipeline import run_pack  # noqa: E402
from packsft.prompt_formats import Tokenization, tokenize_conversation  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
MIX = {"gsm8k_train": 0.35, "hh_rlhf_harmless_base_test": 0.2, "gpteacher": 0.35, "chitchat": 0.1}
FORMATS = {"nemotron-nano-v2": "nemotron-h-layout-tekken", "chat-template": "qwen2.5"}
GPU_ROWS_PER_S = 1.0
MODEL = {"params": 1.24e9, "layers": 16, "d_model": 2048}
H100_BF16_FLOPS, MFU = 989e12, 0.40


def gpu_rows_per_s_estimate(seq_len: int) -> float:
    """FLOP-based training rows/s of one GPU for the 1B model (see the module docstring)."""
    flops = 6 * MODEL["params"] * seq_len + 6 * MODEL["layers"] * seq_len**2 * MODEL["d_model"]
    return H100_BF16_FLOPS * MFU / flops


def write_mix(folder: Path, conversations: int) -> Path:
    """The first conversations of each file of :data:`MIX`, in proportion, as one input JSONL."""
    out = folder / "mix.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for name, share in MIX.items():
            with open(SHARED_DATA / "chat" / f"{name}.messages.jsonl", encoding="utf-8") as src:
                for k, line in enumerate(src):
                    if k >= int(conversations * share):
                        break
                    f.write(line)
    return out


def measure_cached(ds: PackedSFTDataset, rows: int, seed: int) -> dict[str, float]:
    """Time ``ds[i]`` (token cache) over ``rows`` random rows (with replacement), then stage by stage."""
    assert ds.token_cache is not None, ds.token_cache_status
    rng = random.Random(seed)
    order = [rng.randrange(len(ds)) for _ in range(rows)]
    ds[order[0]]  # warm-up
    start = time.perf_counter()
    for i in order:
        ds[i]
    total = time.perf_counter() - start
    stages = {"read cache": 0.0, "build_row": 0.0}
    real = 0
    for i in order:
        t0 = time.perf_counter()
        tokens, targets, lengths = ds.token_cache.row(i)
        t1 = time.perf_counter()
        row, _ = build_row_flat(tokens, targets, lengths, ds.prompt_format.pad_token_id, ds.max_seq_len,
                                ds.context_parallel_size)
        t2 = time.perf_counter()
        stages["read cache"] += t1 - t0
        stages["build_row"] += t2 - t1
        real += int(row["cu_seqlens"][-1])
    staged = sum(stages.values())
    return {"rows": len(order), "seconds": total, "rows_per_s": len(order) / total,
            "real_tokens_per_s": real / total, "row_tokens_per_s": len(order) * ds.max_seq_len / total,
            "split": " / ".join(f"{v / staged:.0%}" for v in stages.values())}


def measure(ds: PackedSFTDataset, rows: int, seed: int) -> dict[str, float]:
    """Time ``ds[i]`` (re-tokenizing) over ``rows`` random rows, then the same rows stage by stage."""
    assert ds.token_cache is None
    order = random.Random(seed).sample(range(len(ds)), min(rows, len(ds)))
    ds[order[0]]  # warm-up
    start = time.perf_counter()
    for i in order:
        ds[i]
    total = time.perf_counter() - start
    stages = {"read+parse+split": 0.0, "tokenize": 0.0, "build_row": 0.0}
    real = 0
    for i in order:
        t0 = time.perf_counter()
        convs = split_row(ds.read_messages(i), ds.path, ds.line_number(i))
        t1 = time.perf_counter()
        tokenization = Tokenization.of(ds.tokenizer, ds.prompt_format)
        pieces = [tokenize_conversation(c.messages, tokenization, c.tools) for c in convs]
        t2 = time.perf_counter()
        build_row(pieces, ds.prompt_format.pad_token_id, ds.max_seq_len, ds.context_parallel_size)
        t3 = time.perf_counter()
        stages["read+parse+split"] += t1 - t0
        stages["tokenize"] += t2 - t1
        stages["build_row"] += t3 - t2
        real += min(sum(len(t) for t, _ in pieces), ds.max_seq_len)
    staged = sum(stages.values())
    return {"rows": len(order), "seconds": total, "rows_per_s": len(order) / total,
            "real_tokens_per_s": real / total, "row_tokens_per_s": len(order) * ds.max_seq_len / total,
            "split": " / ".join(f"{v / staged:.0%}" for v in stages.values())}


def _line(fmt_name: str, seq_len: int, path: str, r: dict, speedup: str) -> str:
    return (f"{fmt_name:<18}{seq_len:>6}{path:>10}{r['rows']:>6}{r['rows_per_s']:>9.1f}{r['real_tokens_per_s']:>13,.0f}"
            f"{r['row_tokens_per_s']:>12,.0f}{r['rows_per_s'] / GPU_ROWS_PER_S:>9.1f}x"
            f"{r['rows_per_s'] / gpu_rows_per_s_estimate(seq_len):>10.1f}x{speedup:>9}   {r['split']}")


def main(argv: list[str] | None = None) -> int:
    """Pack the mix for each length and format, measure one worker, print a table against the GPU rate."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-seq-lens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--conversations", type=int, default=4000, help="input conversations packed per setting")
    p.add_argument("--rows", type=int, default=60, help="rows timed per setting, re-tokenizing")
    p.add_argument("--cached-rows", type=int, default=2000, help="rows timed per setting, from the token cache")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # truncation reports are not part of the timing
    print(f"GPU consumption assumed: {GPU_ROWS_PER_S:g} row/s/GPU (1B model, 8K); FLOP estimate at {MFU:.0%} MFU "
          f"of an H100: " + ", ".join(f"{L}: {gpu_rows_per_s_estimate(L):.1f} rows/s" for L in args.max_seq_lens))
    header = (f"{'format':<18}{'L':>6}{'path':>10}{'rows':>6}{'rows/s':>9}{'real tok/s':>13}{'row tok/s':>12}"
              f"{'x 1 row/s':>10}{'x FLOP est':>11}{'vs retok':>9}   time split")
    print(header)
    print(f"{'':<40}time split: re-tokenize = read+parse / tokenize / build_row; cached = read cache / build_row")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        mix = write_mix(folder, args.conversations)
        for fmt_name in args.formats:
            tokenizer = SHARED_DATA / "tokenizers" / FORMATS[fmt_name]
            for seq_len in args.max_seq_lens:
                out = folder / f"{fmt_name}-{seq_len}.jsonl.packed"
                run_pack(PackConfig(inputs=[str(mix)], output=str(out), tokenizer=str(tokenizer), max_seq_len=seq_len,
                                    prompt_format=fmt_name, histogram="", progress=False))
                plain = PackedSFTDataset(out, tokenizer, fmt_name, seq_len, use_token_cache=False)
                r = measure(plain, args.rows, args.seed)
                print(_line(fmt_name, seq_len, "retok", r, ""), flush=True)
                cached = PackedSFTDataset(out, plain.tokenizer, fmt_name, seq_len)
                c = measure_cached(cached, args.cached_rows, args.seed)
                print(_line(fmt_name, seq_len, "cached", c, f"{c['rows_per_s'] / r['rows_per_s']:.0f}x"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

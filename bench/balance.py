#!/usr/bin/env python
"""Per-rank cost balance of ``loader.balance``: max/mean cost over data-parallel ranks per step, ``none`` vs
``attention``, on the shared chat data packed at 8K.

    python bench/balance.py                                  # packs shared/data/chat at 8K once, into a temp folder
    python bench/balance.py --packed out/chat_8k.jsonl.packed --tokenizer ../shared/data/tokenizers/qwen2.5

Setup: the five files of ``shared/data/chat`` (chitchat, gpteacher, gsm8k test and train, hh-rlhf) packed with
``tools/pack_megatron_sft_jsonl.py`` (``--prompt-format chat-template``, qwen2.5's tokenizer, ``--max-seq-length
8192``, best-fit decreasing), unless ``--packed`` names a packed file. The training loader
(:func:`packsft.data.loader.build_train_dataloader`, ``sampler: random``) of every rank is built in this process
for each ``dp_size`` and ``balance``; one epoch of global batches of ``--global-batch-size`` rows is drawn.

Cost of a rank in a step: over its rows, ``attention = sum(s_i ** 2)`` (``s_i`` the rows' real segment lengths,
their ``cu_seqlens``), and the FLOPs ``6 * N * L + 6 * layers * d_model * sum(s_i ** 2)`` per row for the 1B model
``bench/loader.py`` assumes (Llama-3.2-1B: N = 1.24e9, 16 layers, d_model 2048; causal attention halves the
``12 * ...`` term): the linear part is the same for every row (``L`` tokens each), so balancing the attention
balances both. Printed: max/mean over ranks per step (one line per mode), and over the epoch its mean and
worst, for each mode; the plan's time per global batch (the assignment on top of reading the lengths from the
token cache). A pure CPU measurement: no model runs. Exit code 1 when ``attention`` has a higher mean
max/mean than ``none``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from packsft.data.balance import AttentionBalance, attention_cost, segment_lengths_reader
from packsft.data.dataset import PackedSFTDataset
from packsft.data.loader import DataLoaderConfig, build_train_dataloader

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
FILES = ("chitchat", "gpteacher", "gsm8k_test", "gsm8k_train", "hh_rlhf_harmless_base_test")
MODEL = {"params": 1.24e9, "layers": 16, "d_model": 2048}


def pack(folder: Path, tokenizer: Path, max_seq_len: int) -> Path:
    """Pack the shared chat files with the packer's CLI; return the packed file."""
    out = folder / f"chat_{max_seq_len}.jsonl.packed"
    subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "pack_megatron_sft_jsonl.py"), "--input",
                    *(str(SHARED_DATA / "chat" / f"{name}.messages.jsonl") for name in FILES), "--output", str(out),
                    "--tokenizer", str(tokenizer), "--max-seq-length", str(max_seq_len), "--prompt-format",
                    "chat-template", "--no-progress"], check=True, stdout=subprocess.DEVNULL)
    return out


def rank_rows(dataset, dp_size: int, global_batch_size: int, balance: str, steps: int) -> list[list[list[int]]]:
    """Per step, per rank: the row indices the loader of each rank yields (one loader per rank, in process)."""
    cfg = DataLoaderConfig(sampler="random", seed=1234, micro_batch_size=1, balance=balance)
    per_rank = global_batch_size // dp_size
    out = [[[] for _ in range(dp_size)] for _ in range(steps)]
    for rank in range(dp_size):
        sampler = build_train_dataloader(dataset, cfg, dp_rank=rank, dp_size=dp_size,
                                         global_batch_size=global_batch_size).batch_sampler
        micro = iter(sampler)
        for step in range(steps):
            for _ in range(per_rank):
                out[step][rank] += next(micro)
    return out


def ratios(per_step: list[list[list[int]]], cost: dict[int, float]) -> list[float]:
    """max/mean over ranks of the summed row costs, per step."""
    result = []
    for ranks in per_step:
        loads = np.array([sum(cost[i] for i in rows) for rows in ranks], dtype=np.float64)
        result.append(float(loads.max() / loads.mean()))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packed", type=Path, help="a packed file (default: pack shared/data/chat at --max-seq-len)")
    parser.add_argument("--tokenizer", type=Path, default=SHARED_DATA / "tokenizers" / "qwen2.5")
    parser.add_argument("--max-seq-len", type=int, default=8192)
    parser.add_argument("--dp-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--global-batch-size", type=int, default=64)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        packed = args.packed or pack(Path(tmp), args.tokenizer, args.max_seq_len)
        dataset = PackedSFTDataset(packed, args.tokenizer, "chat-template", args.max_seq_len)
        lengths = segment_lengths_reader(dataset)
        attention = {i: attention_cost(lengths(i)) for i in range(len(dataset))}
        L = dataset.max_seq_len
        flops = {i: 6 * MODEL["params"] * L + 6 * MODEL["layers"] * MODEL["d_model"] * a for i, a in attention.items()}
        steps = len(dataset) // args.global_batch_size
        s = np.sqrt([max(attention.values()), min(attention.values())])
        print(f"{packed}: {len(dataset)} rows of L={L}; sqrt(sum s^2) per row from {s[1]:.0f} to {s[0]:.0f}; "
              f"global batch {args.global_batch_size} rows, {steps} steps (one epoch, sampler random)")
        batch = list(range(args.global_batch_size))
        started = time.perf_counter()
        for _ in range(20):
            AttentionBalance(dataset)(batch, max(args.dp_sizes), 1)       # a fresh plan: no cached costs
        plan_ms = (time.perf_counter() - started) / 20 * 1e3
        print(f"plan time per global batch (dp {max(args.dp_sizes)}, lengths from the token cache): {plan_ms:.2f} ms")
        print("| dp | rows/rank | cost | none mean | none worst | attention mean | attention worst |")
        print("|---|---|---|---|---|---|---|")
        worse = False
        for dp in args.dp_sizes:
            runs = {mode: rank_rows(dataset, dp, args.global_batch_size, mode, steps) for mode in ("none", "attention")}
            for name, cost in (("sum s^2", attention), ("FLOPs 1B", flops)):
                got = {mode: ratios(runs[mode], cost) for mode in runs}
                print(f"| {dp} | {args.global_batch_size // dp} | {name} | {np.mean(got['none']):.3f} | "
                      f"{max(got['none']):.3f} | {np.mean(got['attention']):.3f} | {max(got['attention']):.3f} |")
                worse |= np.mean(got["attention"]) > np.mean(got["none"])
                for mode in runs:
                    print(f"  dp {dp} {name} {mode} per step: " + " ".join(f"{r:.3f}" for r in got[mode]))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())

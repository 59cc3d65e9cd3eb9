"""Where a training step's time goes on one GPU: profiler tables of a train step and the attention variants' costs.

``torch.profiler`` tables of ``Trainer.train_step``, and the attention backend's cost on the same packed rows.

    python bench/gpu_profile_step.py --config configs/tiny_cpu.yaml [overrides ...] [--steps 2 --warmup 2]

On an H200 with the ~1B model of ``bench/gpu_check.sh`` (8192-token rows, 4 per step) allow 5 minutes: building the
trainer, the steps (about 3 s each there) and the profiler's tables; progress lines are printed as they come.

Takes the same ``--config`` and overrides as ``tools/train.py`` (one process). Prints

* the wall time of each profiled step (synchronised) and the device-busy share: the kernels' summed device time over
  the wall time (below 1: the GPU waits for the host, e.g. on Python or kernel-launch overhead);
* the ops with the most device time, and the ops with the most host time (``torch.profiler`` tables);
* for the first micro-batch's row: forward + backward of layer 0's core attention as built (``torch`` backend: one
  SDPA per conversation), one causal SDPA over the whole row (a lower bound: it ignores the conversations), and
  ``torch.nn.attention.varlen.varlen_attn`` on the row's ``cu_seqlens`` when this PyTorch has it (else the reason),
  with the varlen output's max abs difference from the built backend.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, repeat: int = 5) -> float:
    """Median seconds of ``fn()`` (synchronised), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def attention_costs(trainer, batch: dict) -> list[tuple[str, str]]:
    """``(variant, text)`` rows: fwd+bwd time of layer 0's core attention variants on ``batch``'s row."""
    cfg = trainer.cfg.model
    psp = batch["packed_seq_params"]
    t = batch["tokens"].shape[1]
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads
    head_dim = cfg.hidden_size // heads
    dtype = torch.bfloat16 if trainer.cfg.train.bf16 else torch.float32
    device = batch["tokens"].device
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(t, heads, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
    k, v = (torch.randn(t, groups, head_dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
            for _ in range(2))
    core = trainer.gpt.decoder.layers[0].self_attention.core_attention
    cu = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
    rows = []

    def built():
        return core(q, k, v, None, packed_seq_params=psp)

    def whole_row():
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                             enable_gqa=heads != groups)
        return out[0].transpose(0, 1).flatten(1)

    variants = [("built backend (" + type(core).__name__ + ")", built), ("one causal SDPA, whole row", whole_row)]
    reference = built().float()
    cu32 = cu.to(device=device, dtype=torch.int32)
    longest = int((cu32[1:] - cu32[:-1]).max())

    def varlen():
        """Causal varlen attention over the row; its keywords changed between releases (2.10: ``is_causal``; 2.11:
        ``window_size``; 2.12: ``enable_gqa`` too), so the newest form is tried first, with K/V repeated per query
        head where GQA is not a keyword."""
        from torch.nn.attention.varlen import varlen_attn

        args = (cu32, cu32, longest, longest)
        try:
            return varlen_attn(q, k, v, *args, window_size=(-1, 0), enable_gqa=heads != groups).flatten(1)
        except TypeError:
            k_rep, v_rep = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
            try:
                return varlen_attn(q, k_rep, v_rep, *args, window_size=(-1, 0)).flatten(1)
            except TypeError:
                return varlen_attn(q, k_rep, v_rep, *args, is_causal=True).flatten(1)

    try:
        got = varlen()
    except Exception as err:  # noqa: BLE001 - reported in the table: this PyTorch's varlen API may differ or lack it
        rows.append(("varlen_attn", f"unavailable: {type(err).__name__}: {err}"[:160]))
    else:
        diff = (got.float() - reference).abs().max().item()
        variants.append((f"varlen_attn (max abs diff {diff:.2e})", varlen))
    n_conv = len(cu) - 1
    for name, fn in variants:
        def step(fn=fn):
            fn().float().sum().backward()
        rows.append((name, f"{_timed(step) * 1e3:8.2f} ms fwd+bwd, {t} tokens, {n_conv} segments"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Other arguments are tools/train.py's KEY=VALUE overrides. The ~1B run of "
                                            "bench/gpu_check.sh: GPU_CHECK_PARTS=profile bash bench/gpu_check.sh")
    parser.add_argument("--config", required=True, help="training YAML, as tools/train.py --config")
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the profile")
    parser.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    args, overrides = parser.parse_known_args(argv)

    from packsft.train.config import load_config
    from packsft.train.distributed import destroy_distributed
    from packsft.train.loop import Trainer

    start = time.perf_counter()
    trainer = Trainer(load_config(args.config, overrides))
    print(f"trainer built in {time.perf_counter() - start:.1f} s", flush=True)   # progress: a timeout keeps it
    try:
        for i in range(args.warmup):
            start = time.perf_counter()
            trainer.train_step(trainer.next_micro_batches())
            print(f"warm-up step {i + 1}: {time.perf_counter() - start:.3f} s", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        walls = []
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                batches = trainer.next_micro_batches()
                _sync()
                start = time.perf_counter()
                trainer.train_step(batches)
                _sync()
                walls.append(time.perf_counter() - start)
        events = prof.key_averages()
        device_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6   # us -> s
        tokens = trainer.cfg.train.global_batch_size * trainer.cfg.data.max_seq_len
        busy = (f"device busy {device_total / sum(walls):.1%} of the wall time (under the profiler)"
                if torch.cuda.is_available() else "device busy: n/a (no GPU)")
        print(f"steps {', '.join(f'{w:.3f}' for w in walls)} s; {tokens / (sum(walls) / len(walls)):.0f} tokens/s; "
              f"{busy}", flush=True)
        if torch.cuda.is_available():
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        for name, text in attention_costs(trainer, batches[0]):
            print(f"attention  {name:<45} {text}", flush=True)
    finally:
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s of the packsft training step against a plain Megatron-Core step, same model and rows, one process.

    python bench/train.py --packed rows.jsonl.packed --tokenizer TOKENIZER_DIR --max-seq-len 256 [--steps 10]

Both variants run on the same ``GPTModel`` object and the same pre-collated packed rows (the loader is excluded from
the timing), alternating in rounds so that machine noise hits both:

* ``packsft``: ``Trainer.train_step`` (global token count, fused linear-CE by default, DDP-ready scaling, TP-aware
  clipping, AdamW + schedule).
* ``plain``: ``GPTModel(tokens, position_ids, None, labels=..., packed_seq_params=...)`` -> Megatron's
  ``vocab_parallel_cross_entropy`` -> ``(loss * mask).sum() / mask.sum()`` -> backward ->
  ``clip_grad_norm_`` -> ``torch.optim.AdamW.step``; the shape of ``examples/run_simple_mcore_train_loop.py``.

Prints steps/s, tokens/s (all row tokens) and ratio packsft/plain (target >= 99 %); with CUDA also MFU
(``6 * parameters * tokens/s / --peak-tflops``, attention FLOPs ignored). Timings on a shared CPU are noisy.

``--recompute`` instead compares activation recompute settings (``model.recompute_*``): none, selective
(``core_attn``), selective (``core_attn`` + ``mlp``) and full (uniform, 1 layer per chunk), one ``Trainer`` each
(same seed, same rows), steps alternating in rounds. Per setting it prints the median step time and the peak
memory of one ``train_step`` above what was live before it (activations, transient gradients, loss buffers):
on CUDA ``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs``) with glibc's mmap threshold lowered to 64 KiB so that freed tensors leave the RSS. Both
as ratios against the no-recompute setting of the same run.

``--lora`` measures the same way full fine-tuning against LoRA (``lora.enabled``, rank 16, all four targets): step
time, peak step memory, and the trainable parameters and optimizer-state elements each keeps.

``--pipeline`` instead measures the pipeline bubble: the median ``Trainer.train_step`` time T1 at PP=1 (this
process) and TP at PP=P (``--pp`` processes under ``torchrun``, gloo on CPU, Megatron's 1F1B schedule), the same rows
and global batch; every process single-threaded (``--threads``) so that PP=P
has P times the cores. Stage compute share ``s``: each stage's matmul parameters (the word embedding counts only
where it is the output layer) over the model's; with ``m`` micro-batches per step the slowest stage sets the pace,
ideally ``TP = T1 * s_max * (m + P - 1) / m`` (``T1 / P * (m + P - 1) / m`` for balanced stages). Printed: ``TP / T1``
next to both ideals, and the slowest stage's idle fraction ``1 - s_max * T1 / TP`` (bubble plus send/recv) next to
the theoretical bubble ``(P - 1) / (m + P - 1)``. Rounds alternate PP=1 and a fresh PP=P launch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def plain_step(gpt, optimizer, batches) -> None:
    """One optimizer step of the plain Megatron-Core loop over ``batches`` (stock loss on full logits)."""
    import torch

    total = sum(float((b["loss_mask"] * (b["labels"] != -100)).sum()) for b in batches)
    for b in batches:
        mask = b["loss_mask"] * (b["labels"] != -100)
        per_token = gpt(b["tokens"], b["position_ids"], None, labels=b["labels"].clamp(min=0),
                        packed_seq_params=b["packed_seq_params"])
        ((per_token * mask).sum() / max(total, 1.0)).backward()
    torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, sync) -> float:
    """Seconds one call of ``fn`` takes (with a device sync before reading the clock)."""
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


RECOMPUTE_SETTINGS = {
    "none": [],
    "selective core_attn": ["model.recompute_granularity=selective"],
    "selective core_attn+mlp": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]"],
    "full uniform 1": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                       "model.recompute_num_layers=1"],
}


def _rss_kib(field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of this process from ``/proc/self/status``, KiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def peak_step_bytes(fn) -> int:
    """Peak bytes one call of ``fn`` held above what was live before it (CUDA allocator, or RSS on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")                                         # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    fn()
    return (_rss_kib("VmHWM") - before) * 1024


LORA_SETTINGS = {
    "none": [],
    "lora r16": ["lora.enabled=true", "lora.rank=16", "lora.alpha=32"],
}


def recompute_sweep(args, base_overrides: list[str], settings: dict | None = None, label: str = "recompute") -> None:
    """Time and measure ``Trainer.train_step`` for each setting (default :data:`RECOMPUTE_SETTINGS`) against none."""
    import ctypes

    import torch

    from packsft.train.config import load_config
    from packsft.train.loop import Trainer

    if not torch.cuda.is_available():
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)        # M_MMAP_THRESHOLD: big frees return to the OS
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    trainers, rows = {}, None
    for name, overrides in (settings or RECOMPUTE_SETTINGS).items():
        trainers[name] = Trainer(load_config(None, base_overrides + overrides))
        rows = rows or [trainers[name].next_micro_batches() for _ in range(args.steps)]
        trainers[name].train_step(rows[0])                      # warm-up: optimizer state, lazy inits
    seconds = {name: [] for name in trainers}
    peak = {name: [] for name in trainers}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            peak[name].append(peak_step_bytes(lambda t=trainer: t.train_step(rows[0])))
            for b in rows:
                seconds[name].append(timed(lambda t=trainer, b=b: t.train_step(b), sync))
    gpt = trainers["none"].gpt
    params = sum(p.numel() for p in gpt.parameters())
    cfg = trainers["none"].cfg
    print(f"{label}: model {params / 1e6:.2f} M parameters ({cfg.model.num_layers} layers, "
          f"h {cfg.model.hidden_size}, ffn {cfg.model.ffn_hidden_size}), {args.max_seq_len}-token rows, "
          f"{args.global_batch_size} per step, "
          f"loss {args.loss}, device {trainers['none'].ctx.device}; {args.rounds} rounds x {args.steps} steps; "
          f"fp32 gradients alone: {4 * params / 2**20:.1f} MiB")
    base_peak = statistics.median(peak["none"])
    base_time = statistics.median(seconds["none"])
    for name in trainers:
        p, t = statistics.median(peak[name]), statistics.median(seconds[name])
        trained = sum(q.numel() for q in trainers[name].gpt.parameters() if q.requires_grad)
        state = sum(v.numel() for st in trainers[name].optimizer.state.values() for v in st.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        print(f"  {name:<24} peak {p / 2**20:8.1f} MiB ({p / base_peak:5.2f}x)   "
              f"step {t:7.3f} s ({t / base_time:5.2f}x)   peaks MiB {[round(x / 2**20) for x in peak[name]]}   "
              f"trained {trained / 1e6:.2f} M, optimizer state {state / 1e6:.2f} M elements")


def _timed_steps(trainer, rows, sync, barrier) -> list[float]:
    """Seconds of ``trainer.train_step`` per pre-collated step in ``rows`` (after one warm-up step)."""
    trainer.train_step(rows[0])
    out = []
    for b in rows:
        barrier()
        out.append(timed(lambda b=b: trainer.train_step(b), lambda: (sync(), barrier())))
    return out


def _stage_params(trainer) -> tuple[int, int]:
    """``(parameters, matmul parameters)`` of this rank's chunks (a lookup-only word embedding is no matmul)."""
    total = matmul = 0
    for g in trainer.gpts:
        for name, p in g.named_parameters():
            total += p.numel()
            lookup = name == "embedding.word_embeddings.weight" and not (
                g.post_process and g.share_embeddings_and_output_weights)
            matmul += 0 if lookup else p.numel()
    return total, matmul


def pipeline_worker(args, overrides: list[str]) -> None:
    """One rank of the PP run: time ``args.steps`` steps; rank 0 writes ``{seconds, params}`` to ``--pipeline-out``."""
    import json

    import torch
    import torch.distributed as dist

    from packsft.train.config import load_config
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(None, overrides + [f"parallel.pipeline_model_parallel_size={args.pp}"]))
    rows = [trainer.next_micro_batches() for _ in range(args.steps)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    seconds = _timed_steps(trainer, rows, sync, dist.barrier)
    params = [None] * dist.get_world_size()
    dist.all_gather_object(params, _stage_params(trainer))
    if dist.get_rank() == 0:
        Path(args.pipeline_out).write_text(json.dumps({"seconds": seconds, "params": params}))


def pipeline_bubble(args, overrides: list[str]) -> None:
    """PP=1 here vs PP=``args.pp`` under ``torchrun``, alternating rounds; print step times and bubble ratios."""
    import json
    import os
    import subprocess
    import tempfile

    import torch

    from packsft.train.config import load_config
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(None, overrides))
    rows = [trainer.next_micro_batches() for _ in range(args.steps)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    one, two, params = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "pp.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.pp}",
               __file__, *sys.argv[1:], "--pipeline-worker", "--pipeline-out", str(out)]
        for _ in range(args.rounds):
            one += _timed_steps(trainer, rows, sync, lambda: None)
            subprocess.run(cmd, check=True, env=env)
            result = json.loads(out.read_text())
            two += result["seconds"]
            params = result["params"]
    m, p = len(rows[0]), args.pp
    t1, t2 = statistics.median(one), statistics.median(two)
    share = max(x[1] for x in params) / _stage_params(trainer)[1]
    cfg = trainer.cfg
    print(f"pipeline: model {_stage_params(trainer)[0] / 1e6:.2f} M parameters ({cfg.model.num_layers} layers, "
          f"h {cfg.model.hidden_size}, ffn {cfg.model.ffn_hidden_size}, vocab {cfg.model.vocab_size}), "
          f"{args.max_seq_len}-token rows, global batch {args.global_batch_size} = m {m} micro-batches per step, "
          f"loss {args.loss}, {args.threads} thread(s) per process, device {trainer.ctx.device}; "
          f"{args.rounds} rounds x {args.steps} steps; per stage parameters / matmul parameters (M) "
          f"{[(round(a / 1e6, 2), round(b / 1e6, 2)) for a, b in params]}, slowest stage share {share:.3f}")
    print(f"  PP=1 step {t1:7.3f} s   (steps {[round(x, 2) for x in one]})")
    print(f"  PP={p} step {t2:7.3f} s   (steps {[round(x, 2) for x in two]})")
    print(f"  T{p}/T1 measured {t2 / t1:.3f}   ideal with these stages s_max (m+P-1)/m "
          f"{share * (m + p - 1) / m:.3f}   ideal with balanced stages (m+P-1)/(m P) {(m + p - 1) / (m * p):.3f}")
    print(f"  slowest stage idle measured 1 - s_max T1/T{p} {1 - share * t1 / t2:.3f}   "
          f"theoretical bubble (P-1)/(m+P-1) {(p - 1) / (m + p - 1):.3f}")


def main() -> None:
    """Parse arguments, build the trainer, time both loops, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packed", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=2)
    parser.add_argument("--model", nargs="*", default=["model.num_layers=2", "model.hidden_size=64",
                                                          "model.ffn_hidden_size=128", "model.num_attention_heads=4",
                                                          "model.num_query_groups=2"])
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="GPU peak (H100 bf16 dense: 989)")
    parser.add_argument("--loss", choices=["fused", "stock"], default="fused", help="packsft loss path")
    parser.add_argument("--recompute", action="store_true",
                        help="compare activation recompute settings (peak memory, step time) instead")
    parser.add_argument("--lora", action="store_true",
                        help="compare full fine-tuning with LoRA (peak memory, step time, optimizer state) instead")
    parser.add_argument("--pipeline", action="store_true",
                        help="measure the pipeline bubble: PP=1 vs PP=--pp (torchrun, gloo on CPU) instead")
    parser.add_argument("--pp", type=int, default=2, help="pipeline size for --pipeline")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process for --pipeline")
    parser.add_argument("--pipeline-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    import torch

    if args.pipeline:
        torch.set_num_threads(args.threads)

    from packsft.train.config import load_config
    from packsft.train.loop import Trainer

    overrides = [
        f"data.train_path={args.packed}", f"data.tokenizer={args.tokenizer}", f"data.max_seq_len={args.max_seq_len}",
        "model.vocab_size=49152", f"model.max_position_embeddings={args.max_seq_len}",
        f"train.global_batch_size={args.global_batch_size}", f"train.train_steps={10 * args.steps * args.rounds}",
        "checkpoint.resume=none", "logging.progress=false", "logging.tensorboard=false",
        f"loss.fused_linear_cross_entropy={args.loss == 'fused'}",
        *(["train.autocast_dtype=bfloat16", "model.attention_backend=te"] if torch.cuda.is_available() else []),
        *args.model]
    if args.recompute or args.lora:
        recompute_sweep(args, overrides, LORA_SETTINGS if args.lora else None, "lora" if args.lora else "recompute")
        return
    if args.pipeline:
        (pipeline_worker if args.pipeline_worker else pipeline_bubble)(args, overrides)
        return
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    rows = [trainer.next_micro_batches() for _ in range(args.steps)]
    plain_opt = torch.optim.AdamW(trainer.gpt.parameters(), lr=cfg.optimizer.lr)
    variants = {"packsft": lambda b: trainer.train_step(b), "plain": lambda b: plain_step(trainer.gpt, plain_opt, b)}
    for fn in variants.values():                                   # warm-up
        fn(rows[0])
    seconds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            seconds[name].append(sum(timed(lambda b=b, fn=fn: fn(b), sync) for b in rows))
    tokens = args.steps * args.global_batch_size * args.max_seq_len
    params = sum(p.numel() for p in trainer.gpt.parameters())
    print(f"model {params / 1e6:.2f} M parameters, {args.global_batch_size} rows x {args.max_seq_len} tokens per step, "
          f"{args.steps} steps x {args.rounds} rounds, device {trainer.ctx.device}, packsft loss {args.loss}")
    rate = {name: tokens / statistics.median(s) for name, s in seconds.items()}
    for name, value in rate.items():
        mfu = f"  MFU {6 * params * value / (args.peak_tflops * 1e12):.1%}" if torch.cuda.is_available() else ""
        print(f"  {name:<8} {value:10.0f} tokens/s  (median of {args.rounds} rounds, s/round {seconds[name]}){mfu}")
    print(f"  ratio packsft/plain: {rate['packsft'] / rate['plain']:.1%}")


if __name__ == "__main__":  # dist_checkpointing / spawn workers re-import this file
    main()

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
    args = parser.parse_args()

    import torch

    from packsft.train.config import load_config
    from packsft.train.loop import Trainer

    cfg = load_config(None, [
        f"data.train_path={args.packed}", f"data.tokenizer={args.tokenizer}", f"data.max_seq_len={args.max_seq_len}",
        "model.vocab_size=49152", f"model.max_position_embeddings={args.max_seq_len}",
        f"train.global_batch_size={args.global_batch_size}", f"train.train_steps={10 * args.steps * args.rounds}",
        "checkpoint.resume=none", "logging.progress=false", "logging.tensorboard=false",
        f"loss.fused_linear_cross_entropy={args.loss == 'fused'}",
        *(["train.autocast_dtype=bfloat16", "model.attention_backend=te"] if torch.cuda.is_available() else []),
        *args.model])
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

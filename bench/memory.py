"""Measured CPU peak memory of one training step vs the formula of ``packsft.train.memory`` (docs/memory.md).

Builds a small GPT (fp32, the ``torch`` attention backend, fused loss) in Megatron's DDP with Megatron's optimizer,
then measures the peak resident memory of one step (forward, backward, gradient reduction, AdamW step) above the
memory held before it (the weights and DDP's ``main_grad`` buffer): AdamW moments, activations and loss buffers.
Prints measured / formula for each row length. The peak is read from ``VmHWM`` after resetting it through
``/proc/self/clear_refs`` (Linux).

    python bench/memory.py --seq-lens 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
             vocab_size=8192)
CONVERSATION = 128   # tokens per conversation in the measured row


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(seq_len: int, chunk_size: int) -> dict:
    """One step on a row of ``seq_len`` tokens in this process; measured and predicted bytes."""
    import torch

    sys.path.insert(0, str(REPO))
    from packsft.data.context_parallel import make_packed_seq_params
    from packsft.model.config import ModelConfig
    from packsft.model.gpt import build_gpt_model
    from packsft.model.output_head import use_hidden_state_output
    from packsft.train.config import OptimizerConfig
    from packsft.train.distributed import init_distributed
    from packsft.train.memory import Layout, plan, static_breakdown
    from packsft.train.optim import build_megatron_optimizer
    from packsft.train.token_loss import gpt_token_loss

    init_distributed()
    torch.manual_seed(0)
    model_cfg = ModelConfig(**SHAPE, max_position_embeddings=seq_len)
    model = build_gpt_model(model_cfg)
    use_hidden_state_output(model)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    model.config.calculate_per_token_loss = True
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = build_megatron_optimizer(model, OptimizerConfig(lr=1e-4), bf16=False)
    cu = torch.arange(0, seq_len + 1, CONVERSATION, dtype=torch.int32)
    batch = {"tokens": torch.randint(0, SHAPE["vocab_size"], (1, seq_len)),
             "labels": torch.randint(0, SHAPE["vocab_size"], (1, seq_len)),
             "loss_mask": torch.ones(1, seq_len),
             "position_ids": torch.arange(seq_len).remainder(CONVERSATION)[None],
             "packed_seq_params": make_packed_seq_params(cu, CONVERSATION)}
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")            # reset VmHWM to the current RSS
    per_token, mask = gpt_token_loss(model, batch, fused=True, chunk_size=chunk_size)
    (per_token.sum() / mask.sum()).backward()
    finalize_model_grads([model])
    optimizer.step()
    peak = _status("VmHWM") - before
    layout = Layout(autocast=False, attention_backend="torch", chunk_size=chunk_size)
    p = plan(model_cfg, layout, seq_len, gpu_bytes=1e12)
    held = p.parameters * (static_breakdown(layout)["weights"] + static_breakdown(layout)["grads"])
    predicted = p.total - held               # the weights and DDP's main_grad buffer were held before the step
    return {"seq_len": seq_len, "measured_bytes": peak, "predicted_bytes": predicted,
            "activations": p.activations, "ratio": peak / predicted}


def main(argv: list[str] | None = None) -> int:
    """Measure each row length in a fresh process and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)   # child mode: measure one length, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.chunk_size)))
        return 0
    print(f"{'L':>6} {'measured MiB':>13} {'formula MiB':>12} {'ratio':>6}")
    for n in args.seq_lens:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--chunk-size", str(args.chunk_size)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{n:>6} {r['measured_bytes'] / 2**20:>13.1f} {r['predicted_bytes'] / 2**20:>12.1f} {r['ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

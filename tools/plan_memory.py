"""How much GPU memory a training config needs, and how long a packed row fits (the formula of docs/memory.md).

For the config's own layout and row length::

    python tools/plan_memory.py --config configs/llama3_8b_multigpu.yaml --gpu-memory 80GB --world-size 16

Which layouts of a world size fit rows of given lengths (TP in 1..8, CP and PP powers of two, with and without
the distributed optimizer, recompute and sequence parallelism)::

    python tools/plan_memory.py --config configs/llama3_8b_multigpu.yaml --gpu-memory 80GB --world-size 16 \\
        --sweep --seq-lens 8192 32768 131072

Arguments after the flags are dotted config overrides, as for tools/train.py. Estimates, not measurements.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from packsft.config_rules import positive_int  # noqa: E402
from packsft.layout import MAX_SEQ_LEN  # noqa: E402
from packsft.train.compat import load_train_config  # noqa: E402
from packsft.train.config import check_parallel_layout  # noqa: E402
from packsft.train.memory import GiB, Layout, format_plan, layout_from_config, max_seq_len, plan  # noqa: E402

UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> float:
    """``"80GB"`` -> 8e10, ``"141GiB"`` -> 141 * 2**30.

    Raises:
        ValueError: not a positive number with a unit (B, KB, MB, GB, KiB, MiB, GiB), or under 1 GB (a GPU).
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise ValueError(f"--gpu-memory {text!r}: expected a size with its unit, like 80GB or 141GiB")
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if value < 1e9:
        raise ValueError(f"--gpu-memory {text!r} is under 1 GB; give the memory of one GPU, like 80GB")
    return value


def sweep(model, base: Layout, world_size: int, seq_lens: list[int], gpu_bytes: float) -> list[str]:
    """Markdown rows: every layout of ``world_size`` GPUs and the longest row it fits, marked per length."""
    lines = ["| TP | CP | PP | DP | dist. opt. | SP | recompute | static GiB | L_max | "
             + " | ".join(f"{n // 1024}k" for n in seq_lens) + " |",
             "|" + "---|" * (9 + len(seq_lens))]
    powers = [2**i for i in range(8) if 2**i <= world_size]
    for tp, cp, pp in itertools.product([t for t in powers if t <= 8], powers, powers):
        if world_size % (tp * cp * pp):
            continue
        try:
            model.check_parallel_fit(tp, pp)
        except ValueError:      # a size the model does not split over
            continue
        for dist_opt, recompute in ((False, None), (True, None), (True, "full")):
            layout = replace(base, tp=tp, cp=cp, pp=pp, dp=world_size // (tp * cp * pp),
                             bf16=True, autocast=False, distributed_optimizer=dist_opt, recompute=recompute,
                             sequence_parallel=tp > 1, recompute_num_layers=1)
            longest = max_seq_len(model, layout, gpu_bytes)
            if longest < min(seq_lens):
                continue
            static = plan(model, layout, 2 * cp, gpu_bytes).weights_grads_optimizer / GiB
            marks = " | ".join("yes" if longest >= n else "" for n in seq_lens)
            lines.append(f"| {tp} | {cp} | {pp} | {layout.dp} | {'yes' if dist_opt else 'no'} | "
                         f"{'yes' if tp > 1 else 'no'} | {recompute or 'none'} | {static:.1f} | "
                         f"{longest // 1024}k | {marks} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the plan (or the sweep); exit 2 on a config error."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", required=True, help="training YAML (configs/*.yaml)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory of one GPU, e.g. 80GB, 141GiB (default 80GB)")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="GPUs of the job (default: TP x CP x PP of the config, i.e. DP = 1)")
    parser.add_argument("--sweep", action="store_true", help="list the layouts of --world-size that fit")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None,
                        help="row lengths for --sweep (tokens; default 8192 32768 131072)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.max_seq_len=32768")
    args = parser.parse_args(argv)
    if args.seq_lens is not None and not args.sweep:  # it was ignored
        parser.error("--seq-lens is for --sweep; without it the plan is for the config's data.max_seq_len "
                     "(override it: data.max_seq_len=32768)")
    args.seq_lens = args.seq_lens or [8192, 32768, 131072]
    try:
        if any(not 1 <= n <= MAX_SEQ_LEN for n in args.seq_lens):
            raise ValueError(f"--seq-lens must be token counts from 1 to {MAX_SEQ_LEN:,}, got {args.seq_lens}")
        gpu_bytes = parse_bytes(args.gpu_memory)
        cfg = load_train_config(args.config, args.overrides)
        par = cfg.parallel
        world = args.world_size or (par.tensor_model_parallel_size * par.context_parallel_size
                                    * getattr(par, "pipeline_model_parallel_size", 1))
        layout = layout_from_config(cfg, check_parallel_layout(cfg, world))
        if args.sweep:
            print("\n".join(sweep(cfg.model, layout, world, sorted(args.seq_lens), gpu_bytes)))
            return 0
        p = plan(cfg.model, layout, cfg.data.max_seq_len, gpu_bytes)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(p, cfg.model, layout))
    longest, positions = max_seq_len(cfg.model, layout, gpu_bytes), cfg.model.max_position_embeddings
    cap = f" (in memory; model.max_position_embeddings caps this config's rows at {positions})" if longest > positions \
        else ""
    print(f"longest row that fits : {longest} tokens{cap}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Summarise the training runs of ``bench/gpu_check.sh``: tokens/s, MFU, peak memory and loss, and the sync ratio.

Reads run folders of ``tools/train.py`` over the same rows and settings except ``logging.log_interval``: ``every``
(1: Python numbers and a ``torch.cuda.synchronize()`` every step, what the step did before it kept its numbers on the
device) and ``sparse`` (10: numbers only every 10 steps); with ``--resumed``, a run that resumed from the checkpoint
of a run stopped half-way (``train.stop_at_step``): its per-step losses are compared with ``every``'s (a preempted
job must continue on the same batches and optimizer state), beside the same difference over the first half (the
stopped run against ``every``: how far two identical runs differ on this device). Steps after the first
``--warmup`` are averaged. MFU is ``6 * parameters * tokens/s / peak`` (attention FLOPs ignored, as in
``bench/train.py``), with the bf16 dense peak of the GPU named on the command line (H100/H200 SXM: 989 TFLOP/s);
without a known peak it is left out.

    python bench/gpu_check_train.py --every out/every --sparse out/sparse --gpu "NVIDIA H200"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from packsft.train.metrics import peak_tflops  # noqa: E402 - the trainer's table of dense bf16 peaks


def _records(run: Path) -> list[dict]:
    """The records of ``run``'s ``metrics.jsonl``."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summarise(run: Path, warmup: int) -> dict:
    """Mean tokens/s over the steps after ``warmup`` (weighted by the steps each record covers), last memory, losses.

    Raises:
        ValueError: no train record after the warm-up.
    """
    records = _records(run)
    params = next(r["parameters"] for r in records if r.get("kind") == "summary")
    train = [r for r in records if r.get("kind") == "train"]
    timed = [r for r in train if r["step"] > warmup]
    if not timed:
        raise ValueError(f"{run}: no train record after step {warmup}")
    steps = [r["step"] - prev for r, prev in zip(timed, [warmup] + [r["step"] for r in timed[:-1]])]
    seconds = sum(s * r["step_time_s"] for s, r in zip(steps, timed))
    tokens = sum(s * r["tokens_per_s"] * r["step_time_s"] for s, r in zip(steps, timed))
    return {"parameters": params, "tokens_per_s": tokens / seconds, "mem_gib": train[-1]["mem_gib"],
            "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"], "steps": train[-1]["step"]}


def losses(run: Path) -> dict[int, float]:
    """``{step: loss}`` of a run logged every step."""
    return {r["step"]: r["loss"] for r in _records(run) if r.get("kind") == "train"}


def resume_check(every: Path, resumed: Path, steps: int, rel_tol: float = 1e-3) -> dict:
    """Max relative loss differences: resumed run vs ``every`` after the stop, and the stopped run (the checkpoint's
    source, folder ``<resumed's parent>/train_stop``) vs ``every`` before it. ``ok``: the resumed run logged exactly
    the steps after the stop, every loss compared is finite, and the resumed losses are within ``rel_tol`` of the
    uninterrupted run's. A missing or incomplete run gives ``ok: False`` with ``error``, not an exception."""
    try:
        full, after, before = losses(every), losses(resumed), losses(resumed.parent / "train_stop")
    except (OSError, ValueError, KeyError) as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "stopped_at": 0, "resumed_steps": [],
                "rerun_rel_diff": float("nan"), "resume_rel_diff": float("nan")}
    stop = max(before, default=0)

    def rel(a: dict[int, float]) -> float:
        """Max relative difference from ``full`` over ``a``'s steps; NaN when any value is missing or not finite."""
        if not a or not set(a) <= set(full):
            return float("nan")
        diffs = [abs(a[s] - full[s]) / max(abs(full[s]), 1e-12) for s in sorted(a)]
        return max(diffs) if all(map(math.isfinite, diffs)) else float("nan")

    ok = stop == steps // 2 and sorted(after) == list(range(stop + 1, steps + 1))
    resumed_diff = rel(after)
    return {"stopped_at": stop, "resumed_steps": sorted(after), "rerun_rel_diff": rel(before),
            "resume_rel_diff": resumed_diff, "ok": ok and resumed_diff <= rel_tol}   # NaN <= tol is False


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def main(argv: list[str] | None = None) -> int:
    """Print the table rows and write ``--json``; exit 1 when a run is incomplete or its loss did not fall."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=Path, required=True, help="run folder with logging.log_interval=1")
    parser.add_argument("--sparse", type=Path, required=True, help="run folder with logging.log_interval=10")
    parser.add_argument("--resumed", type=Path, default=None,
                        help="run folder resumed from the checkpoint of <its parent>/train_stop (logged every step)")
    parser.add_argument("--gpu", default="", help="GPU name, for the MFU peak")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the averages")
    parser.add_argument("--steps", type=int, default=20, help="steps each run must reach")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    every, sparse = summarise(args.every, args.warmup), summarise(args.sparse, args.warmup)
    peak = peak_tflops(args.gpu)
    mfu = 6 * sparse["parameters"] * sparse["tokens_per_s"] / (peak * 1e12) if peak else None
    ok = all(r["steps"] == args.steps and r["last_loss"] < r["first_loss"] for r in (every, sparse))
    result = {"gpu": args.gpu, "every_step_sync": every, "sync_every_10": sparse, "mfu": mfu,
              "sync_ratio": sparse["tokens_per_s"] / every["tokens_per_s"], "ok": ok}
    mfu_text = f", MFU {mfu:.1%}" if mfu is not None else ""
    print(f"{'train-1b-bf16-distopt':<30} {'ok' if ok else 'FAIL':<8} {_params(sparse['parameters'])} params, "
          f"{sparse['tokens_per_s']:.0f} tokens/s{mfu_text}, peak {sparse['mem_gib']:.1f} GiB, "
          f"loss {sparse['first_loss']:.3f} -> {sparse['last_loss']:.3f}")
    print(f"{'step-without-syncs':<30} {'ok' if ok else 'FAIL':<8} tokens/s logging every 10 steps / every step: "
          f"{result['sync_ratio']:.3f} ({sparse['tokens_per_s']:.0f} / {every['tokens_per_s']:.0f})")
    if args.resumed:
        result["resume"] = res = resume_check(args.every, args.resumed, args.steps)
        ok &= res["ok"]
        print(f"{'resume-after-stop':<30} {'ok' if res['ok'] else 'FAIL':<8} stopped at step {res['stopped_at']}, "
              f"resumed steps {_span(res['resumed_steps'])}: max rel loss diff vs the "
              f"uninterrupted run {res['resume_rel_diff']:.2e} after the stop, {res['rerun_rel_diff']:.2e} before")
    result["ok"] = ok
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Plot the training (and validation) loss of a run from its ``metrics.jsonl`` to a PNG.

::

    python examples/plot_loss.py --metrics out/demo/train/metrics.jsonl --out out/demo/train/loss.png

``metrics.jsonl`` is the trainer's (``packsft/train/metrics.py``): ``kind == "train"`` records give ``step`` and
``loss`` (global-batch mean token loss, nats), ``kind == "validation"`` records ``val_loss``, and a ``summary`` record
opens every start of the run, so a resumed run appends after the checkpoint's step. A step logged twice (by a run
killed before its checkpoint, then by the resumed run) is plotted with its later record. Each restart after the first
is drawn as a dashed vertical line. Needs matplotlib (installed with packsft, it draws the packer's histogram).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_curves(metrics: str | Path) -> dict[str, list]:
    """``{"train": [(step, loss)], "validation": [(step, val_loss)], "validation_sets": {name: [(step, loss)]},
    "restarts": [step]}`` from ``metrics.jsonl`` (``validation_sets`` from the ``val_loss/<name>`` keys).

    Raises:
        FileNotFoundError: no such file. ValueError: a line that is not JSON (the message names the line).
    """
    train: dict[int, float] = {}
    val: dict[int, float] = {}
    sets: dict[str, dict[int, float]] = {}
    starts: list[int] = []
    for number, line in enumerate(Path(metrics).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{metrics}:{number}: not JSON ({err})") from err
        kind = record.get("kind")
        if kind == "train":
            train[record["step"]] = record["loss"]
        elif kind == "validation":
            val[record["step"]] = record["val_loss"]
            for key, value in record.items():
                if key.startswith("val_loss/"):
                    sets.setdefault(key.removeprefix("val_loss/"), {})[record["step"]] = value
        elif kind == "summary":
            starts.append(record["step"])
    return {"train": sorted(train.items()), "validation": sorted(val.items()),
            "validation_sets": {name: sorted(points.items()) for name, points in sets.items()}, "restarts": starts[1:]}


def plot(curves: dict[str, list], out: str | Path, title: str = "packsft training loss") -> Path:
    """Write the loss curves of :func:`read_curves` to ``out`` (PNG, 100 dpi) and return its path.

    Raises:
        ValueError: there is no training record to plot.
    """
    if not curves["train"]:
        raise ValueError("no 'train' records in the metrics file: nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, losses = zip(*curves["train"])
    ax.plot(steps, losses, marker=".", label="train loss (global batch)")
    named = curves.get("validation_sets") or {}
    if len(named) > 1:                                   # one curve per named validation set
        for name, points in named.items():
            vsteps, vlosses = zip(*points)
            ax.plot(vsteps, vlosses, marker="o", linestyle="--", label=f"validation loss: {name}")
    elif curves["validation"]:
        vsteps, vlosses = zip(*curves["validation"])
        ax.plot(vsteps, vlosses, marker="o", linestyle="--", label="validation loss")
    for i, step in enumerate(curves["restarts"]):
        ax.axvline(step, color="grey", linestyle=":", label="resumed from checkpoint" if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean token loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """Read ``--metrics``, write ``--out``; exit code 2 on a missing or empty metrics file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="packsft training loss")
    args = parser.parse_args(argv)
    try:
        curves = read_curves(args.metrics)
        path = plot(curves, args.out, args.title)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    first, last = curves["train"][0], curves["train"][-1]
    print(f"loss {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]}); plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

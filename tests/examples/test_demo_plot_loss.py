"""examples/plot_loss.py: curves from a resumed run's metrics.jsonl (later record of a step wins) and the PNG."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from plot_loss import main, read_curves  # noqa: E402


def write_metrics(path: Path) -> Path:
    """Run 1: steps 1-3 (step 3 killed before its checkpoint at 2); run 2 resumes at 2 and redoes 3, then 4."""
    records = [{"kind": "summary", "step": 0}, {"kind": "validation", "step": 0, "val_loss": 4.0},
               *({"kind": "train", "step": s, "loss": 5.0 - s} for s in (1, 2, 3)),
               {"kind": "summary", "step": 2}, {"kind": "train", "step": 3, "loss": 1.5},
               {"kind": "train", "step": 4, "loss": 1.0}, {"kind": "validation", "step": 4, "val_loss": 2.5}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return path


def test_read_curves_keeps_the_resumed_record_and_marks_restarts(tmp_path):
    curves = read_curves(write_metrics(tmp_path / "metrics.jsonl"))
    assert curves["train"] == [(1, 4.0), (2, 3.0), (3, 1.5), (4, 1.0)]
    assert curves["validation"] == [(0, 4.0), (4, 2.5)]
    assert curves["restarts"] == [2]


def test_main_writes_a_png_and_reports_errors(tmp_path, capsys):
    out = tmp_path / "plots" / "loss.png"
    assert main(["--metrics", str(write_metrics(tmp_path / "m.jsonl")), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "4.0000 (step 1) -> 1.0000 (step 4)" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"kind": "summary", "step": 0}\nnot json\n')
    assert main(["--metrics", str(tmp_path / "bad.jsonl"), "--out", str(out)]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text('{"kind": "summary", "step": 0}\n')
    with pytest.raises(ValueError, match="no 'train' records"):
        from plot_loss import plot

        plot(read_curves(tmp_path / "empty.jsonl"), out)

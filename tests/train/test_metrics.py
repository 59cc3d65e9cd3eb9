"""Warnings and log records print through the progress bar, not into it."""

import logging
import warnings

from packsft.train.metrics import MetricsLogger


def test_warnings_and_logging_go_through_the_bar_while_it_is_shown(tmp_path, capsys):
    before = warnings.showwarning
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, progress=True, initial_step=0, total_steps=4)
    assert warnings.showwarning == logger._warn_through_bar
    written = []
    write = logger._bar.write
    logger._bar.write = lambda text, **kw: (written.append(text), write(text, **kw))
    logger.progress({"loss": 1.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0, "mem_gib": 0.0})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("row 3 right-truncated to max_seq_len", UserWarning, stacklevel=1)
    logging.getLogger("packsft.test").warning("a log record")
    logger.close()
    assert any("UserWarning: row 3 right-truncated to max_seq_len" in t for t in written), written
    assert "a log record" in capsys.readouterr().err
    assert warnings.showwarning is before                     # restored by close()


def test_without_a_bar_warnings_are_left_alone(tmp_path):
    before = warnings.showwarning
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, progress=False, initial_step=0, total_steps=4)
    assert warnings.showwarning is before
    logger.close()


def test_records_past_the_restart_step_are_set_aside(tmp_path):
    lines = ['{"kind": "summary", "step": 0}', '{"kind": "train", "step": 1}', '{"kind": "validation", "step": 2}',
             '{"kind": "train", "step": 2}', '{"kind": "train", "step": 3}', '{"kind": "tr']   # killed mid-line
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, progress=False, initial_step=2,
                           total_steps=4, restart_step=2)
    assert logger.set_aside == 2
    logger.log({"kind": "summary", "step": 2})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [*lines[:4], '{"kind": "summary", "step": 2}']
    assert (tmp_path / "metrics.discarded.jsonl").read_text().splitlines() == lines[4:]
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False, progress=False, initial_step=0,
                           total_steps=4, restart_step=-1)                # a start without a checkpoint
    logger.close()
    assert logger.set_aside == 5 and (tmp_path / "metrics.jsonl").read_text() == ""
    assert len((tmp_path / "metrics.discarded.jsonl").read_text().splitlines()) == 7
    assert MetricsLogger(tmp_path / "new", enabled=True, tensorboard=False, progress=False, initial_step=0,
                         total_steps=4, restart_step=-1).set_aside == 0

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

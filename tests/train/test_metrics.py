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


def _batch(cu):
    from types import SimpleNamespace

    import torch

    return {"packed_seq_params": SimpleNamespace(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))}


def test_step_meter_reports_trained_tokens_per_s_packing_efficiency_and_mfu():
    """Two steps of 2 rows of 8 tokens: real tokens and squared conversation lengths from the rows' cu_seqlens."""
    import pytest
    import torch

    from packsft.train.checkpointer import TrainState
    from packsft.train.metrics import StepMeter, row_lengths

    assert row_lengths([_batch([0, 3, 7]), _batch([0, 8])]).tolist() == [15, 9 + 16 + 64]
    meter = StepMeter(torch.device("cpu"), log_interval=2, last_step=10, max_skipped_steps=0, start_step=0)
    meter.set_flops(parameters=1000, heads_times_head_dim=16, layers=2, world_size=2,
                    device_name="NVIDIA H100 80GB HBM3")
    state = TrainState()
    for step, (cus, trained) in enumerate([([[0, 3, 7], [0, 8]], 12), ([[0, 5], [0, 2, 4, 6]], 9)], start=1):
        meter.add(torch.tensor(trained), torch.tensor(False), row_lengths([_batch(cu) for cu in cus]))
        state.step = step
        assert meter.should_log(step) == (step == 2)
    meter.read(state)
    record = meter.record(state, {"loss": torch.tensor(1.0), "trained_tokens": torch.tensor(9)}, rows=2, seq=8)
    seconds = record["step_time_s"] * 2
    assert state.trained_tokens == 21 and record["trained_tokens"] == 9
    assert record["packing_efficiency"] == (15 + 11) / 32
    assert record["trained_tokens_per_s"] == pytest.approx(21 / seconds)
    squares = 9 + 16 + 64 + 25 + 3 * 4
    flops = 6 * 1000 * 32 + 6 * 16 * 2 * squares
    assert record["mfu"] == pytest.approx(flops / seconds / (989e12 * 2))
    meter.set_flops(parameters=1000, heads_times_head_dim=16, layers=2, world_size=1, device_name=None)
    meter.add(torch.tensor(1), torch.tensor(False), row_lengths([_batch([0, 8])]))
    state.step = 4
    meter.read(state)
    assert meter.record(state, {"trained_tokens": torch.tensor(1)}, rows=1, seq=8)["mfu"] is None   # CPU


def test_mfu_of_a_llava_step_counts_each_images_vision_flops_once():
    """Images are counted from the logged image tokens (4 per image here); each adds vision_flops_per_image."""
    from types import SimpleNamespace

    import pytest
    import torch

    from packsft.train.checkpointer import TrainState
    from packsft.train.metrics import StepMeter, row_lengths, vision_flops_per_image

    vision = SimpleNamespace(hidden_size=32, num_layers=2)
    per_image = vision_flops_per_image(1000, 200, vision, 4)
    assert per_image == 6 * 1000 * 5 + 6 * 32 * 2 * 25 + 6 * 200 * 4
    meter = StepMeter(torch.device("cpu"), log_interval=1, last_step=10, max_skipped_steps=0, start_step=0,
                      media=True)
    meter.set_flops(parameters=500, heads_times_head_dim=16, layers=2, world_size=1,
                    device_name="NVIDIA H100 80GB HBM3", image_flops=per_image, image_seq_length=4)
    state = TrainState()
    meter.add(torch.tensor(3), torch.tensor(False), row_lengths([_batch([0, 8])]), media=(12, 4))  # 3 images
    state.step = 1
    meter.read(state)
    record = meter.record(state, {"trained_tokens": torch.tensor(3)}, rows=1, seq=8)
    assert (record["image_tokens"], record["text_tokens"]) == (12, 4)
    flops = 6 * 500 * 8 + 6 * 16 * 2 * 64 + 3 * per_image
    assert record["mfu"] == pytest.approx(flops / record["step_time_s"] / 989e12)


def test_step_meter_counts_each_sources_trained_tokens_across_reads_and_resumes():
    """A mixture's rows carry their source: per-source trained tokens add up over reads, survive a checkpoint's
    dict, and their shares are logged."""
    from dataclasses import asdict

    import torch

    from packsft.data.collate import collate_rows
    from packsft.train.checkpointer import TrainState
    from packsft.train.metrics import StepMeter, row_lengths

    def row(source, trained):
        return {**{k: torch.zeros(4, dtype=torch.int64) for k in ("tokens", "labels", "position_ids")},
                "loss_mask": torch.zeros(4), "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32),
                "cu_seqlens_padded": torch.tensor([0, 4], dtype=torch.int32), "max_seqlen": 4,
                "num_trained_tokens": trained, "source": source}

    batch = collate_rows([row(0, 3), row(1, 1), row(0, 2)])
    assert batch["trained_tokens_by_source"] == [(0, 3), (1, 1), (0, 2)]
    meter = StepMeter(torch.device("cpu"), 1, 10, 0, 0, sources=["chat", "tools"])
    state = TrainState(step=1)
    lengths = row_lengths([_batch([0, 4, 8, 12])])
    meter.add(torch.tensor(6), torch.tensor(False), lengths, batch["trained_tokens_by_source"])
    meter.read(state)
    state = TrainState.from_dict(asdict(state))      # as a resume reads it
    meter.add(torch.tensor(2), torch.tensor(False), row_lengths([_batch([0, 4, 8, 12])]), [(1, 2)])
    state.step = 2
    meter.read(state)
    record = meter.record(state, {"trained_tokens": torch.tensor(2)}, rows=3, seq=4)
    assert state.source_trained_tokens == {"chat": 5, "tools": 3}
    assert (record["total_trained_tokens/chat"], record["trained_token_share/tools"]) == (5, 3 / 8)


def _dp_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from packsft.train.checkpointer import TrainState
    from packsft.train.metrics import StepMeter, row_lengths

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    meter = StepMeter(torch.device("cpu"), 1, 1, 0, 0, dp_group=dist.group.WORLD)
    meter.add(torch.tensor(5), torch.tensor(False), row_lengths([_batch([0, 2 + rank])]))   # global count 5
    state = TrainState(step=1)
    meter.read(state)
    return state.trained_tokens, meter.record(state, {"trained_tokens": torch.tensor(5)}, 2, 4)["packing_efficiency"]


def test_step_meter_sums_the_ranks_rows_once_each():
    from distributed_helpers import run_distributed

    assert run_distributed(_dp_worker, 2) == [(5, 5 / 8), (5, 5 / 8)]

"""The checkpoint folder before step 1 (writable, room for one checkpoint), a save that runs out of space,
``checkpoint.keep_last`` pruning, and ``checkpoint.resume=none`` over an earlier run."""

import errno
import shutil
import subprocess
import sys
import tempfile
from collections import namedtuple
from pathlib import Path

import pytest
from distributed_helpers import megatron_optimizer, parallel_state_1proc  # noqa: F401 - fixture
from test_checkpoint import tiny_model
from test_loop import packed, write_config  # noqa: F401 - fixture

from packsft.train import checkpoint as ckpt
from packsft.train import checkpoint_files as ckpt_files
from packsft.train.config import OptimizerConfig, load_config

Usage = namedtuple("Usage", "total used free")
GIB = 2**30


def test_a_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # e.g. logging.output_dir=<a file>: was "(Not a directory)"
    with pytest.raises(ckpt_files.CheckpointDirError, match=f"checkpoint.dir .*file/checkpoints is not writable "
                       f"\\({blocker} is a file, not a folder\\)"):
        ckpt_files.check_checkpoint_dir(blocker / "checkpoints", 1)
    read_only = tmp_path / "ro"
    read_only.mkdir()

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(tempfile, "mkstemp", refuse)   # tests run as root, which a chmod does not stop
    with pytest.raises(ckpt_files.CheckpointDirError, match="ro is not writable \\(Permission denied\\)"):
        ckpt_files.check_checkpoint_dir(read_only, 1)


def test_too_little_free_space_says_how_much_is_needed(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * GIB, 99 * GIB, GIB))
    ckpt_files.check_checkpoint_dir(tmp_path, GIB)                                     # exactly enough
    with pytest.raises(ckpt_files.CheckpointDirError,
                       match="has 1.00 GiB free but one checkpoint needs about 3.00 GiB"):
        ckpt_files.check_checkpoint_dir(tmp_path, 3 * GIB)


def test_trainer_checks_the_folder_before_step_1(tmp_path, packed, parallel_state_1proc, monkeypatch):  # noqa: F811
    from packsft.train.loop import Trainer

    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * GIB, 100 * GIB, 1000))
    cfg = load_config(write_config(tmp_path / "c.yaml", packed, tmp_path / "o"))
    with pytest.raises(ckpt_files.CheckpointDirError, match="has 0.00 GiB free but one checkpoint needs about") as err:
        Trainer(cfg)
    # fp32 weights + two fp32 Adam moments: 12 bytes per parameter
    model = tiny_model(0)
    assert ckpt.checkpoint_bytes_estimate(list(model.parameters())) == 12 * sum(p.numel() for p in model.parameters())
    assert "o/checkpoints" in str(err.value)


def _save(path, step, model, opt, **kwargs):
    return ckpt.save_checkpoint(path, step, model, opt, train_state={"state": {"step": step}}, loader_state=None,
                                dp_rank=0, write_loader_state=False, **kwargs)


def _dcp_failure(exc):
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException("save", {0: (exc, None)})


@pytest.mark.parametrize("failure", [
    lambda: OSError(errno.ENOSPC, "No space left on device"),
    lambda: _dcp_failure(OSError(errno.ENOSPC, "No space left on device")),     # torch DCP's per-rank wrapping
    lambda: RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598"),  # torch.save
], ids=["oserror", "wrapped", "torch_save"])
def test_a_save_that_runs_out_of_space_says_so(tmp_path, parallel_state_1proc, monkeypatch, failure):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    _save(tmp_path, 1, model, opt)

    def full(*args, **kwargs):
        raise failure()
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * GIB, 100 * GIB, 0))
    with pytest.raises(ckpt_files.CheckpointSpaceError, match="no space left for checkpoint .*iter_0000002.tmp .*"
                       "needs about 2.00 GiB, 0.00 GiB free .*iter_0000001 \\(latest\\) is intact") as err:
        _save(tmp_path, 2, model, opt, need_bytes=2 * GIB)
    assert err.value.errno == errno.ENOSPC
    assert (tmp_path / "latest").read_text().strip() == "iter_0000001"


def test_other_save_errors_pass_through(tmp_path, parallel_state_1proc, monkeypatch):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())

    def broken(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(ckpt.dist_checkpointing, "save", broken)
    with pytest.raises(PermissionError):
        _save(tmp_path, 1, model, opt)


def test_keep_last_prunes_older_complete_checkpoints(tmp_path, parallel_state_1proc):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    for step in range(1, 5):
        _save(tmp_path, step, model, opt, keep_last=2)
    (tmp_path / "iter_0000005.tmp").mkdir()                                    # a killed save: not touched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "iter_0000005.tmp",
                                                          "latest"]
    assert ckpt_files.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "iter_0000004"


def test_prune_never_removes_the_latest_checkpoint(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / ckpt_files.checkpoint_name(step)).mkdir()
        (tmp_path / ckpt_files.checkpoint_name(step) / ckpt_files.TRAIN_STATE).write_text("{}")
    (tmp_path / "iter_0000009").mkdir()                                        # incomplete: no train_state.json
    (tmp_path / ".iter_0000000.deleting").mkdir()                              # left by a killed prune
    (tmp_path / "latest").write_text("iter_0000002\n")                         # e.g. resumed from an older one
    removed = ckpt_files.prune_checkpoints(tmp_path, 1)
    # iter_0000003 is of the run this one does not continue: kept until this run's step 3 replaces it (the highest
    # step was kept and this run's own earlier checkpoints deleted: keep_last=1 kept two, one of them stale)
    assert [p.name for p in removed] == ["iter_0000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000003", "iter_0000009", "latest"]
    (tmp_path / "latest").write_text("iter_0000003\n")
    assert [p.name for p in ckpt_files.prune_checkpoints(tmp_path, 1)] == ["iter_0000002"]


def test_resume_none_refuses_a_folder_with_an_earlier_run(tmp_path):
    out, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    ckpt_files.check_fresh_start("none", out, ckpt_dir)                              # nothing there
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "summary", "step": 0}\n')     # a start that never trained
    ckpt_files.check_fresh_start("none", out, ckpt_dir)
    (out / "metrics.jsonl").write_text('{"kind": "summary", "step": 0}\n{"kind": "train", "step": 1}\n')
    with pytest.raises(ckpt_files.CheckpointDirError, match="resume=none but the run folder holds an earlier run .*"
                       "metrics.jsonl has training records.*new folder"):
        ckpt_files.check_fresh_start("none", out, ckpt_dir)
    ckpt_files.check_fresh_start("auto", out, ckpt_dir)                              # resuming is fine
    (out / "metrics.jsonl").unlink()
    ckpt_dir.mkdir()
    (ckpt_dir / "latest").write_text("iter_0000004\n")
    with pytest.raises(ckpt_files.CheckpointDirError, match="latest names 'iter_0000004'"):
        ckpt_files.check_fresh_start("none", out, ckpt_dir)
    (ckpt_dir / "latest").write_bytes(b"\xff\xfe")                      # was a UnicodeDecodeError naming no file
    with pytest.raises(ckpt_files.CheckpointDirError, match="latest names '\ufffd\ufffd'"):
        ckpt_files.check_fresh_start("none", out, ckpt_dir)


def test_partial_checkpoints_of_killed_saves_are_removed(tmp_path):
    assert ckpt_files.remove_partial_checkpoints(tmp_path / "missing") == []
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / ckpt_files.TRAIN_STATE).write_text("{}")
    (tmp_path / "iter_0000004.tmp").mkdir()                                    # a save killed half-way
    (tmp_path / "iter_0000004.tmp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "notes.tmp").mkdir()                                           # not a checkpoint's: kept
    (tmp_path / "latest").write_text("iter_0000002\n")
    removed = ckpt_files.remove_partial_checkpoints(tmp_path)
    assert [p.name for p in removed] == ["iter_0000004.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest", "notes.tmp"]


def test_the_folder_logic_imports_no_torch():
    """``checkpoint_files`` is read by tools that never load a tensor (and by ``compat``): it must not import torch."""
    code = "import sys, packsft.train.checkpoint_files; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_a_misspelt_resume_value_is_named_with_the_values_it_can_take(tmp_path):
    """``checkpoint.resume=autoo`` was taken for a folder with no word of ``auto``."""
    from packsft.train.checkpoint_files import find_resume_checkpoint

    with pytest.raises(FileNotFoundError, match=r"checkpoint autoo \(checkpoint.resume='autoo'\) is missing or "
                                                r"incomplete: no train_state.json \(checkpoint.resume is 'auto', "):
        find_resume_checkpoint(tmp_path / "checkpoints", "autoo")
    (tmp_path / "half").mkdir()             # a folder that exists: no hint, it is a damaged checkpoint
    with pytest.raises(FileNotFoundError, match=r"no train_state.json$"):
        find_resume_checkpoint(tmp_path / "checkpoints", str(tmp_path / "half"))

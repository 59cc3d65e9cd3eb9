"""A training process killed with SIGKILL after a checkpoint resumes to the uninterrupted run's losses and weights."""

import os
import signal
import subprocess
import sys
import time

import pytest
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_train_loop import OPTIMIZERS, REPO, assert_same_run, packed, train, write_config  # noqa: F401 - fixture

COMMON = {"train": {"global_batch_size": 2, "train_steps": 8}, "checkpoint": {"save_interval": 3},
          "scheduler": {"warmup_steps": 2, "decay_style": "cosine"}, "optimizer": {"weight_decay": 0.1}}


def _start(config):
    return subprocess.Popen([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={"OMP_NUM_THREADS": "1", "PATH": ""})


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sigkilled_run_resumes_bit_exact(tmp_path, packed, parallel_state_1proc, optimizer):  # noqa: F811
    common = {**COMMON, "data": {"train_path": str(packed["many"])},
              "optimizer": {**COMMON["optimizer"], **OPTIMIZERS[optimizer]}}
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(write_config(tmp_path / "full.yaml", packed, full, **common))
    cfg = write_config(tmp_path / "killed.yaml", packed, killed, **common)
    proc = _start(cfg)
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and latest.read_text().strip() == "iter_0000003"):
        assert proc.poll() is None, f"training ended before its first checkpoint: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint at step 3 within 240 s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "iter_0000008").exists()
    train(cfg)  # checkpoint.resume=auto: continues from `latest`
    assert_same_run(full, killed, steps=8)

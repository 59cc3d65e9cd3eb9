"""A training process killed with SIGKILL after a checkpoint resumes to the uninterrupted run's losses and weights."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_loop import OPTIMIZERS, REPO, assert_same_run, packed, train, write_config  # noqa: F401 - fixture

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
    (killed / "checkpoints" / "iter_0000006.tmp").mkdir(exist_ok=True)   # as a save killed half-way leaves it
    with open(killed / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "loss": 1.0}\n{"kind": "tra')   # steps past the checkpoint, a cut line
    train(cfg)  # checkpoint.resume=auto: continues from `latest`
    assert_same_run(full, killed, steps=8)
    records = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))   # each step once
    discarded = (killed / "metrics.discarded.jsonl").read_text().splitlines()
    assert discarded[-2:] == ['{"kind": "train", "step": 5, "loss": 1.0}', '{"kind": "tra']
    assert not list((killed / "checkpoints").glob("*.tmp"))

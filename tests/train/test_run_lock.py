"""One trainer per run folder (``packsft.train.run_lock``): a second is refused by name on every rank, a killed
holder's lock is taken over."""

import os
import subprocess
import sys

import pytest
from distributed_helpers import run_distributed
from test_loop import REPO, packed, write_config  # noqa: F401 - fixture

from packsft.train.config import load_config
from packsft.train.run_lock import LOCK_FILE, RunFolderInUseError, lock_run_folder

HOLD = ("import sys, time; from packsft.train.run_lock import lock_run_folder; lock_run_folder(sys.argv[1]); "
        "print('locked', flush=True); time.sleep(float(sys.argv[2]))")


def hold(folder, seconds=600):
    """A process holding ``folder``'s lock (it has taken it when this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().strip() == "locked", proc.stderr.read()
    return proc


def test_a_second_holder_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path):
    """Two trainers on one logging.output_dir both ran: the second resumed the first's checkpoint meanwhile."""
    holder = hold(tmp_path)
    try:
        with pytest.raises(RunFolderInUseError, match=f"logging.output_dir {tmp_path} is in use by another trainer: "
                                                      f"pid {holder.pid} on .* holds {tmp_path / LOCK_FILE}"):
            lock_run_folder(tmp_path)
    finally:
        holder.kill()                                         # SIGKILL: no clean-up; the kernel drops the flock
        holder.wait()
    assert f"pid {holder.pid} " in (tmp_path / LOCK_FILE).read_text()
    taker = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path), "0"], capture_output=True, text=True,
                           cwd=REPO, timeout=60)
    assert taker.returncode == 0 and taker.stdout.strip() == "locked", taker.stderr
    assert f"named pid {holder.pid} on" in taker.stderr and "ended without releasing it" in taker.stderr
    assert (tmp_path / LOCK_FILE).read_text() == ""           # a holder that ends normally empties the file
    assert lock_run_folder(tmp_path) == lock_run_folder(tmp_path) == tmp_path / LOCK_FILE   # again: a no-op


def _trainer_on_a_held_folder(rank, world_size, config):
    from packsft.train.loop import Trainer

    try:
        Trainer(load_config(config))
    except RunFolderInUseError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_of_a_second_trainer_exits_with_the_refusal(tmp_path, packed):  # noqa: F811
    out = tmp_path / "run"
    out.mkdir()
    config = write_config(tmp_path / "c.yaml", packed, out)
    holder = hold(out)
    try:
        errors = run_distributed(_trainer_on_a_held_folder, 2, str(config), timeout_s=120)
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(config)],
                              capture_output=True, text=True, timeout=300,
                              env={"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "")})
    finally:
        holder.kill()
        holder.wait()
    assert errors[0] is not None and errors == [errors[0]] * 2, errors   # rank 1 did not wait for rank 0
    assert f"pid {holder.pid} on" in errors[0] and str(out) in errors[0]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [f"error: {errors[0]}"]
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()

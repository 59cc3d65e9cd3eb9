"""What clusters do to jobs: SIGTERM saves and exits 0, and no process of a killed run is left behind.

The process checks launch ``tools/train.py`` under torchrun in a new session with ``PACKSFT_TEST_RUN_ID=<uuid>`` in
the environment (inherited by the workers, the checkpoint writer's Manager and the multiprocessing resource tracker),
kill it, and scan ``/proc`` for processes that still carry the id.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_loop import REPO, assert_same_run, packed, train_forked, write_config  # noqa: F401 - fixture

COMMON = {"train": {"global_batch_size": 2, "train_steps": 60}, "checkpoint": {"save_interval": 2},
          "scheduler": {"warmup_steps": 2, "decay_style": "cosine"}, "optimizer": {"weight_decay": 0.1}}
RESUMED_TO = 20
"""``train.stop_at_step`` of the reference and the resumed runs: they keep COMMON's 60-step schedule and compare the
steps up to it (a stopped run resumes with steps left only if the signal stopped it before)."""


def _env(run_id):
    return {"OMP_NUM_THREADS": "1", "PATH": os.path.dirname(sys.executable), "PACKSFT_TEST_RUN_ID": run_id}


def _marked(run_id: str) -> dict[int, str]:
    """Live processes whose environment holds ``PACKSFT_TEST_RUN_ID=run_id``: pid -> command line."""
    needle = f"PACKSFT_TEST_RUN_ID={run_id}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":                                            # a zombie has ended
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            continue
    return found


def _wait_gone(run_id: str, seconds: float) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    while (left := _marked(run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _train_steps(out: Path) -> list[int]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [r["step"] for line in lines if line.endswith("}") and (r := json.loads(line))["kind"] == "train"]


def _wait_for(cond, proc, what, seconds=240):
    deadline = time.monotonic() + seconds
    while not cond():
        assert proc.poll() is None, f"training ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, packed):  # noqa: F811
    """The run the stopped ones must reproduce: COMMON over ``packed["many"]`` up to step RESUMED_TO, never stopped
    before (and saved only there: the checkpoints between change nothing of the run)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    train_forked(write_config(out / "full.yaml", packed, out / "run", **COMMON,
                              data={"train_path": str(packed["many"])}),
                 "checkpoint.save_interval=0", f"train.stop_at_step={RESUMED_TO}")
    return out / "run"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_sigterm_saves_exits_0_and_resumes_bit_exact(tmp_path, packed, parallel_state_1proc, uninterrupted,  # noqa: F811
                                                     workers):
    """SIGTERM to the trainer's process group, its loader workers included (they must leave the stop to it)."""
    stopped = tmp_path / "stopped"
    cfg = write_config(tmp_path / "stopped.yaml", packed, stopped, **COMMON,
                       data={"train_path": str(packed["many"])}, loader={"num_workers": workers})
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env("single"),
                            start_new_session=True)
    _wait_for(lambda: _train_steps(stopped), proc, "the first step")
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:]       # with workers, before: "DataLoader worker ... killed by signal"
    step = max(_train_steps(stopped))
    assert step < 60, "the run ended before the signal"
    assert step < RESUMED_TO, f"stopped after step {step}: nothing left to resume up to step {RESUMED_TO}"
    assert f"stopped by SIGTERM after step {step}: checkpoint " in out
    assert (stopped / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"
    train_forked(cfg, "checkpoint.save_interval=0", f"train.stop_at_step={RESUMED_TO}")   # resume=auto: `latest`
    assert_same_run(uninterrupted, stopped, steps=RESUMED_TO)


def _torchrun(cfg: Path, run_id: str, launcher: str = "torch.distributed.run", *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2",
                             str(REPO / "tools" / "train.py"), "--config", str(cfg), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(run_id),
                            start_new_session=True)


def _worker(run_id: str, local_rank: int) -> int:
    for pid in _marked(run_id):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"LOCAL_RANK={local_rank}".encode() in env and b"TORCHELASTIC_RUN_ID" in b" ".join(env) \
                and "tools/train.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no worker with LOCAL_RANK={local_rank}: {_marked(run_id)}")


def _stop(proc: subprocess.Popen, run_id: str, kill: str) -> None:
    """Send the stop of ``kill``: SIGTERM to torchrun or to its process group (Slurm, ``kill``), SIGINT to its
    group (a terminal's Ctrl-C), SIGTERM to the trainers only, or to torchrun and every trainer (Slurm's
    ``scancel``: each trainer gets it twice, once forwarded)."""
    if kill == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    elif kill == "sigterm_all":
        trainers = [_worker(run_id, rank) for rank in (0, 1)]
        os.kill(proc.pid, signal.SIGTERM)
        for pid in trainers:
            os.kill(pid, signal.SIGTERM)
    elif kill == "sigterm_group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif kill == "sigint":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        for rank in (0, 1):
            os.kill(_worker(run_id, rank), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("kill", "workers", "launcher"), [
    ("sigterm", 0, "torch.distributed.run"), ("sigterm_group", 1, "torch.distributed.run"),
    ("sigint", 0, "torch.distributed.run"), ("sigterm_trainers", 1, "torch.distributed.run"),
    ("sigterm_all", 1, "packsft.train.launch"), ("sigkill_worker", 0, "torch.distributed.run"),
    ("sigkill_group", 1, "torch.distributed.run")])
def test_no_process_outlives_a_killed_torchrun(tmp_path, packed, kill, workers, launcher):  # noqa: F811
    run_id = uuid.uuid4().hex
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", packed, out, **COMMON, data={"train_path": str(packed["many"])},
                       loader={"num_workers": workers})
    proc = _torchrun(cfg, run_id, launcher)
    try:
        latest = out / "checkpoints" / "latest"
        # after the first checkpoint the writer's Manager (and the resource tracker) exist
        _wait_for(lambda: latest.exists() and max(_train_steps(out), default=0) > 2, proc, "a step after a checkpoint")
        helpers = [cmd for cmd in _marked(run_id).values() if "multiprocessing" in cmd]
        assert len(helpers) >= 2 + 2 * workers, _marked(run_id)   # Manager(s) + resource tracker(s) + loader workers
        if kill.startswith(("sigterm", "sigint")):
            _stop(proc, run_id, kill)
            text, _ = proc.communicate(timeout=240)
            signame = "SIGINT" if kill == "sigint" else "SIGTERM"
            assert f"stopped by {signame} after step" in text, text[-3000:]
            assert "]: Traceback" not in text and "DataLoader worker" not in text, text[-3000:]   # no trainer failed
            if kill == "sigterm_trainers" or launcher != "torch.distributed.run":
                # torchrun sees its workers end with 0: so does it, without a word; packsft's launcher forwards its
                # signal instead of re-raising it
                assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
            else:                                # torchrun re-raises the signal it forwarded (docs/training.md)
                assert proc.returncode == 1 and f"SignalException: Process {proc.pid} got signal" in text, text[-3000:]
            assert not list((out / "checkpoints").glob("*.tmp")), text[-3000:]
            step = int(latest.read_text().strip().removeprefix("iter_"))
            assert step == max(_train_steps(out)) and step < 60
        elif kill == "sigkill_worker":
            os.kill(_worker(run_id, 1), signal.SIGKILL)
        else:                                    # the loader workers end with their trainers too
            os.killpg(proc.pid, signal.SIGKILL)
        left = _wait_gone(run_id, 60)  # torchrun stops the other rank with SIGTERM, then SIGKILL after 30 s
        assert not left, f"still alive 60 s after {kill}: {left}"
    finally:
        for pid in _marked(run_id):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if kill == "sigterm_group":    # the stopped run resumes and trains on (one stop stands for all: they save alike)
        again = train_forked(cfg, "checkpoint.save_interval=0", f"train.stop_at_step={RESUMED_TO}", nproc=2)
        assert _train_steps(out) == list(range(1, RESUMED_TO + 1)) and "resumed_from" in again.stdout


GUARDED_FORK = """
import multiprocessing, os, sys, time
sys.path.insert(0, {repo!r})
from packsft.train import process_guard
if {guard}:
    process_guard.forked_children_die_with_this_process()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("guard", [True, False])
def test_a_forked_child_dies_with_the_trainer(guard):
    """dist_checkpointing forks its file writers during a save; a trainer SIGKILLed then must not leave them."""
    proc = subprocess.Popen([sys.executable, "-c", GUARDED_FORK.format(repo=str(REPO), guard=guard)],
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + (10 if guard else 1)
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert alive != guard               # the control (no guard): the orphan lives on


def _catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGTERM (``SigCgt`` of ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


INTERRUPTED_BUILD = """
import os, runpy, signal, sys
sys.path.insert(0, {repo!r})
from packsft.train import loop
build = loop.Trainer.__init__


def interrupted(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)   # Ctrl-C while the trainer is built
    build(self, *args, **kwargs)


loop.Trainer.__init__ = interrupted
sys.argv = [{train!r}, "--config", {config!r}]
runpy.run_path({train!r}, run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("save_on_sigterm", [True, False])
def test_ctrl_c_during_start_up_stops_cleanly_before_step_1(tmp_path, packed, save_on_sigterm):  # noqa: F811
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", packed, out, **{**COMMON, "data": {"train_path": str(packed["many"])},
                                                           "train": {**COMMON["train"],
                                                                     "save_on_sigterm": save_on_sigterm}})
    train = str(REPO / "tools" / "train.py")
    if save_on_sigterm:   # a real Ctrl-C before the heavy imports
        proc = subprocess.Popen([sys.executable, train, "--config", str(cfg)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_env("startup"))
        _wait_for(lambda: _catches_sigterm(proc.pid), proc, "the stop handler", seconds=60)
        proc.send_signal(signal.SIGINT)
    else:                 # one while the trainer is built: the config read, its handler kept until the first step
        script = INTERRUPTED_BUILD.format(repo=str(REPO), train=train, config=str(cfg))
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=_env("startup"))
    text, _ = proc.communicate(timeout=240)
    assert "Traceback" not in text, text[-3000:]   # without save_on_sigterm: a KeyboardInterrupt traceback before
    if save_on_sigterm:
        assert proc.returncode == 0 and "stopped by SIGINT after step 0: nothing new to save" in text, text[-3000:]
    else:
        assert proc.returncode == 130 and "stopped by SIGINT during start-up" in text, text[-3000:]
    assert _train_steps(out) == [] and not (out / "checkpoints" / "latest").exists()


IGNORED_SIGINT = """
import signal, sys
sys.path.insert(0, {repo!r})
from packsft.train.process_guard import STOP_SIGNAL
signal.signal(signal.SIGINT, signal.SIG_IGN)          # a background job of a script: SIGINT ignored on entry
assert STOP_SIGNAL.install()
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) == STOP_SIGNAL._handle
STOP_SIGNAL.uninstall()
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
print("ok")
"""


def test_an_ignored_sigint_stays_ignored():
    proc = subprocess.run([sys.executable, "-c", IGNORED_SIGINT.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr

"""Run a test function on N gloo processes on localhost and bring results or tracebacks back to pytest.

Usage (the function must be importable by name, i.e. defined at module level of a test file)::

    def _worker(rank, world_size, arg):
        ctx = init_distributed(context_parallel_size=2)
        ...
        return some_picklable_value

    results = run_distributed(_worker, 2, arg)        # list indexed by rank

Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT`` (found by binding port 0; never a fixed port), one torch thread, and starts as a fork of a server
that imported torch and megatron-core once (``forkserver``: nothing of pytest's process state is inherited, as with
``spawn``, but no process imports them anew). A failing rank's traceback is raised in pytest; a hang is stopped
after ``timeout_s``.

:func:`tool_forked` runs a tool's ``main`` (``tools/train.py``, ``tools/convert_checkpoint.py``, ...) the same way, as
its command line would, for runs a test neither signals nor kills: a process per rank, without a new interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, port, args, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch

        torch.set_num_threads(1)
        # plain pickle copies tensors into the message: the queue's own pickler would share them through this
        # process's file descriptors, which vanish when it exits before the parent has read them
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from packsft.train.distributed import destroy_distributed

            destroy_distributed()
        except Exception:  # teardown after a failure is best effort
            pass


PRELOAD = ["torch", "megatron.core", "packsft.train.loop"]
"""Modules the fork server imports once: each rank then starts as a fork of it instead of importing torch and
megatron-core anew (seconds per process on the 2-core CI machine)."""


def _context():
    """The ``forkserver`` start method with :data:`PRELOAD` imported (once per pytest process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, timeout_s: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return results by rank.

    Raises (through ``pytest.fail``) with the first failing rank's traceback, or when the processes
    have not all finished after ``timeout_s`` seconds (they are then terminated).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"distributed test timed out after {timeout_s:.0f} s; "
                            f"finished ranks: {sorted(outputs)}")
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs]
                if dead:
                    pytest.fail(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if status == "error":
                pytest.fail(f"rank {rank} of {world_size} failed:\n{value}", pytrace=False)
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [outputs[r] for r in range(world_size)]


def _main_worker(tool: str, argv: list[str], log_dir: str, env: dict[str, str], cwd: str | None) -> None:
    """``tools/<tool>.py`` as its ``__main__`` block runs it, ``sys.exit(main(argv))``, in the environment ``env``
    only and the folder ``cwd``, with stdout and stderr (fds 1 and 2, a traceback included) written to files of
    ``log_dir`` named by rank. Ends as the interpreter would: the ``atexit`` handlers, then the exit status
    (multiprocessing's own end of a child hung after a run with a loader worker had failed)."""
    import importlib

    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    if cwd:
        os.chdir(cwd)
    rank = env.get("RANK", "0")
    with open(f"{log_dir}/stdout.{rank}", "w") as out, open(f"{log_dir}/stderr.{rank}", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = importlib.import_module(f"tools.{tool}").main(argv)
        except SystemExit as exit_:          # argparse
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()              # as the interpreter's exit: the tool's and its libraries' handlers
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def tool_forked(tool: str, *args, nproc: int = 1, check: bool = True, env: dict[str, str] | None = None,
                cwd: Path | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``tools/<tool>.py args`` on ``nproc`` ranks, each a fork of the tests' fork server
    (:data:`PRELOAD`: torch and megatron-core imported once per pytest process, not per run):
    the tool's ``main`` in fresh processes of one world (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them; none for 1 rank, as ``python tools/<tool>.py``), in the
    environment ``OMP_NUM_THREADS=1 PATH=`` plus ``env`` and the folder ``cwd`` (default: the fork server's). For
    runs a test neither signals nor kills, and which need no torchrun. ``returncode``: the first non-zero exit code
    of a rank (a rank that fails ends the others); stdout and stderr: the ranks' in rank order. ``check``: raise on
    a non-zero exit."""
    ctx = _context()
    argv = [str(a) for a in args]
    base = {"OMP_NUM_THREADS": "1", "PATH": "", **(env or {})}
    world = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(free_port())}
    envs = [{**base, **world, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)] if nproc > 1 else [base]
    with tempfile.TemporaryDirectory(prefix=f"{tool}-log-") as log_dir:
        # not daemons: a rank starts the checkpoint writer's processes
        procs = [ctx.Process(target=_main_worker, args=(tool, argv, log_dir, e, cwd and str(cwd))) for e in envs]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while (running := [p for p in procs if p.exitcode is None]) and time.monotonic() < deadline:
            if any(p.exitcode for p in procs):     # a failed rank: the others may wait for it forever
                time.sleep(1.0)
                break
            wait([p.sentinel for p in running], 1.0)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
        out, err = ("".join((Path(log_dir) / f"{kind}.{r}").read_text() for r in range(nproc)
                            if (Path(log_dir) / f"{kind}.{r}").exists()) for kind in ("stdout", "stderr"))
    codes = [p.exitcode for p in procs]
    returncode = next((c for c in codes if c), 0)
    if check:
        assert returncode == 0, f"tools/{tool}.py: exit codes {codes}: {err[-4000:]}"
    return subprocess.CompletedProcess(argv, returncode, out, err)


@pytest.fixture(scope="module")
def parallel_state_1proc():
    """Megatron ``parallel_state`` for one process (TP=CP=1, gloo), torn down after the module.

    Import it into a test module (``from distributed_helpers import parallel_state_1proc``) and
    request it by name.
    """
    from packsft.train.distributed import destroy_distributed, init_distributed

    ctx = init_distributed()
    yield ctx
    destroy_distributed()


def short_conversation_lines(shared_data, count: int, max_chars: int = 200) -> list[str]:
    """The first ``count`` hh-rlhf lines whose message contents total at most ``max_chars`` characters.

    Short real conversations make packed rows of several conversations at small ``max_seq_len`` for the
    multi-process parity tests.
    """
    import json

    lines = (shared_data / "chat" / "hh_rlhf_harmless_base_test.messages.jsonl").read_text().splitlines()
    short = [line for line in lines
             if sum(len(m.get("content") or "") for m in json.loads(line)["messages"]) <= max_chars]
    return short[:count]


def own_output_dir(config_path) -> str:
    """The override ``logging.output_dir=<config's folder>/out-pid<pid>``: each process that builds a Trainer from a
    shared config gets a run folder of its own (a run folder is locked by the process whose rank 0 uses it)."""
    from pathlib import Path

    return f"logging.output_dir={Path(config_path).parent / f'out-pid{os.getpid()}'}"



def megatron_optimizer(model, cfg=None):
    """Megatron's optimizer over ``model`` (a GPTModel, fp32) in Megatron's DDP, as the trainer builds them; the DDP
    wrapper is kept as ``optimizer.ddp_model`` for :func:`optimizer_step` (the model's parameters are shared)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from packsft.train.config import OptimizerConfig
    from packsft.train.optim import build_megatron_optimizer

    model.config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    optimizer = build_megatron_optimizer(ddp, cfg or OptimizerConfig(), bf16=False)
    optimizer.ddp_model = ddp
    return optimizer


def optimizer_step(optimizer) -> None:
    """After a backward: reduce the DDP gradients, step :func:`megatron_optimizer`'s optimizer, zero the gradients."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([optimizer.ddp_model])
    optimizer.step()
    optimizer.ddp_model.zero_grad_buffer()
    optimizer.zero_grad()


def adam_state(optimizer, param) -> dict:
    """The torch AdamW state of ``param`` inside Megatron's (chained) optimizer."""
    from packsft.train.grad_clip import torch_optimizers

    return next(opt.state[param] for opt in torch_optimizers(optimizer) if param in opt.state)

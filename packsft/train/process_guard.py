"""What a cluster does to a job: SIGTERM (or Ctrl-C's SIGINT) as a request to stop, and no process left behind after
a kill.

* :data:`STOP_SIGNAL`: once installed, the first SIGTERM or SIGINT only sets a flag (the trainer finishes its step,
  saves and exits 0); a second one takes the signal's default action (the process ends at once), except a repeated
  SIGTERM under torchrun, which is the same request arriving twice (Slurm signals every process of a job, and
  torchrun forwards its own copy) and is ignored.
* :func:`die_with_parent`: ``prctl(PR_SET_PDEATHSIG)`` (Linux), so a process is killed when the one that started it
  dies, even by SIGKILL. ``tools/train.py`` sets it in torchrun's workers (torchrun starts them in their own
  sessions, so killing torchrun's process group misses them), and :func:`forked_children_die_with_this_process`
  in every process the trainer forks (``dist_checkpointing``'s file writers are forked during a save).
* :func:`start_checkpoint_writer`: the spawn-context ``multiprocessing`` Manager whose queue ``dist_checkpointing``'s
  file writer uses, started here with :func:`die_with_parent` as its initializer (and SIGTERM/SIGINT ignored, so a
  signal sent to every process of the job does not break the save that follows) (Megatron-Core would start it
  without one on the first save and it would outlive a killed trainer); it is shut down at interpreter exit or by
  :func:`stop_checkpoint_writer`. The multiprocessing resource tracker ends by itself once the processes holding
  its pipe (the trainer and the Manager) are gone. It also puts :func:`write_buckets_supervised` in place of
  Megatron-Core's ``FileSystemWriterAsync.write_preloaded_data_multiproc``, whose wait on its forked writers has no
  end when one of them dies (``count_queue.join()``; e.g. ``psutil`` missing: every writer raises before it reports).

Only the standard library is imported at module level: the Manager's child process imports this module to run
its initializer.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (thread) exits; Linux only.

    Args:
        sig: the signal to receive (default SIGKILL).
        expected_parent: pid the parent should have; if the parent is already another process (it died and this
            one was re-parented), ``sig`` is sent at once.

    Returns:
        True when set; False on other systems or when ``prctl`` fails.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:      # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return True


class StopSignal:
    """A SIGTERM and SIGINT handler that records the signal instead of ending the process (module docstring)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    ACTION = "finishing the current step, then saving and exiting"

    def __init__(self) -> None:
        self.received: str | None = None
        """Name of the first signal received (``"SIGTERM"``, ``"SIGINT"``), or None."""
        self.action = self.ACTION
        """What the process does next, as the line printed on the first signal says."""
        self._previous: dict[int, object] = {}
        self._installed = False

    def install(self) -> bool:
        """Install the handler (main thread only) for each signal not ignored (``SIG_IGN``: e.g. SIGINT of a
        background job of a script, which stays ignored); return whether this call installed it."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS
                          if signal.getsignal(sig) is not signal.SIG_IGN}
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Restore the previous handlers and clear the flag."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous, self.received, self._installed, self.action = {}, None, False, self.ACTION

    def _handle(self, signum, frame) -> None:
        if self.received and signum == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ:
            # under torchrun a repeated SIGTERM is the same request: Slurm signals every process of the job and
            # torchrun forwards its copy; torchrun's own SIGKILL (after --shutdown-timeout) is the escalation
            print(f"packsft: SIGTERM received again (pid {os.getpid()}): still {self.action}", file=sys.stderr,
                  flush=True)
            return
        if self.received:                     # a second stop signal: end now, as without the handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum).name
        print(f"packsft: {self.received} received (pid {os.getpid()}): {self.action}; send it again to end at once",
              file=sys.stderr, flush=True)


STOP_SIGNAL = StopSignal()
"""The process-wide SIGTERM/SIGINT handler."""

_fork_parent: int | None = None
_fork_guard = False


def forked_children_die_with_this_process() -> bool:
    """Set :func:`die_with_parent` in every child this process forks from its main thread (``os.register_at_fork``).

    ``dist_checkpointing``'s writer forks one process per write bucket during a save; without this, a trainer
    killed mid-save (a second signal, SIGKILL) leaves them blocked forever. Forks from other threads are left alone
    (the death signal follows the forking thread, which may end first). Linux only; once per process.

    Returns:
        True when installed by this call.
    """
    global _fork_guard
    if _fork_guard or not sys.platform.startswith("linux"):
        return False
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _fork_guard = True
    return True


def _before_fork() -> None:
    global _fork_parent
    _fork_parent = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _after_fork_in_child() -> None:
    if _fork_parent is not None:
        die_with_parent(signal.SIGKILL, _fork_parent)


_writer_manager = None


def _writer_init(parent: int) -> None:
    """Initializer of the writer Manager: outlive SIGTERM/SIGINT sent to the whole job (the trainer still saves
    through it), die with the trainer."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, parent)


def start_checkpoint_writer() -> None:
    """Start ``dist_checkpointing``'s result-queue Manager with :func:`die_with_parent` (once per process), and
    have its file writers supervised (:func:`write_buckets_supervised`).

    Sets ``megatron.core.dist_checkpointing.strategies.filesystem_async._results_queue``, which Megatron-Core
    creates lazily (without an initializer) when it is still ``None``. Main thread only (the death signal follows
    the thread that started the Manager).
    """
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(write_buckets_supervised)
    if filesystem_async._results_queue is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=_writer_init, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()
    _writer_manager = manager


def stop_checkpoint_writer() -> None:
    """Shut down the Manager of :func:`start_checkpoint_writer` (also done at interpreter exit)."""
    global _writer_manager
    if _writer_manager is None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
    _writer_manager.shutdown()
    _writer_manager = None


WRITER_POLL_S = 0.2
"""How often (seconds) :func:`write_buckets_supervised` looks whether a writer process has ended without a result."""


def write_buckets_supervised(transform_list: list, use_msc: bool, rank: int, write_buckets: list,
                             global_results_queue) -> None:
    """Megatron-Core's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` with a wait bounded by the writers'
    lives: one forked process per write bucket runs Megatron's own ``write_preloaded_data``; a writer that ends
    without handing in its result (an exception outside Megatron's ``try``, a signal, ``os._exit``) ends the wait.

    Args and protocol as Megatron's (it is installed in its place): ``global_results_queue`` receives
    ``{bucket index: [WriteResult, ...]}`` on success, else one exception, which Megatron's
    ``retrieve_write_results`` turns into a ``CheckpointException`` on every rank (``"Worker failure: ..."``):
    the error Megatron's writer caught (e.g. an ``OSError``, errno kept), else a ``RuntimeError`` naming the writer
    process and what it let out (``RuntimeError: psutil is not installed, ...``) or its exit code (``-9``:
    killed). The writers ignore SIGTERM/SIGINT (a signal sent to the whole job lets the save finish) and die with
    this process (:func:`forked_children_die_with_this_process`).
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results, count_queue = ctx.SimpleQueue(), ctx.JoinableQueue()
    procs: list = []
    outcome: dict[int, list] | BaseException | None = None
    gc_was_enabled = gc.isenabled()
    gc.disable()         # as Megatron: a collection in the forked writers would free the parent's CUDA tensors
    try:
        try:
            for i, bucket in enumerate(write_buckets):
                count_queue.put(i)
                procs.append(ctx.Process(target=_write_bucket,
                                         args=(transform_list, use_msc, i, bucket, results, count_queue)))
                procs[-1].start()
        except Exception as err:  # noqa: BLE001 - a fork that fails (EAGAIN, ENOMEM) fails the save
            outcome = RuntimeError(f"rank {rank}: cannot start a checkpoint writer: {type(err).__name__}: {err}")
        else:
            outcome = _collect_writer_results(procs, results)
    finally:
        for p in procs:
            if not isinstance(outcome, dict) and p.exitcode is None:   # failed or interrupted: stop the rest
                p.kill()
            if p.pid is not None:
                p.join()
        if gc_was_enabled:
            gc.enable()
    global_results_queue.put(outcome)


def _collect_writer_results(procs: list, results) -> dict[int, list] | BaseException:
    """Read each writer's ``(index, results or exception)`` until all are in, one failed, or one ended without
    handing in its result (waking when a writer ends, at least every :data:`WRITER_POLL_S` seconds)."""
    from multiprocessing.connection import wait

    got: dict[int, list] = {}
    while len(got) < len(procs):
        if not results.empty():
            idx, res = results.get()
            if idx in got:                # Megatron's writer reported, then failed after it (memory probe)
                continue
            if isinstance(res, BaseException):   # as Megatron: its own (an OSError keeps its errno), or ours
                return res
            got[idx] = res
            continue
        ended = [i for i, p in enumerate(procs) if i not in got and p.exitcode is not None]
        if ended and results.empty():     # a writer's put is in the pipe before it ends (SimpleQueue): none came
            p = procs[ended[0]]
            return RuntimeError(f"checkpoint writer process {ended[0]} (pid {p.pid}) ended with exit code "
                                f"{p.exitcode} without handing in its part of the checkpoint")
        wait([p.sentinel for p in procs if p.exitcode is None], WRITER_POLL_S)
    return got


def _write_bucket(transform_list: list, use_msc: bool, idx: int, bucket, results, count_queue) -> None:
    """A forked writer: Megatron's ``write_preloaded_data`` for one bucket; an exception it lets out (its memory
    probe runs outside its ``try``) is handed in as its result."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        FileSystemWriterAsync.write_preloaded_data(transform_list, idx, bucket, results, count_queue,
                                                   use_fsync=True, use_msc=use_msc)
    except BaseException as err:  # noqa: BLE001 - handed to the parent, which ends the save with it
        results.put((idx, RuntimeError(f"checkpoint writer process {idx} (pid {os.getpid()}) failed: "
                                       f"{type(err).__name__}: {err}")))

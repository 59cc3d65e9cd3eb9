"""The packer's stop signals: SIGTERM and SIGINT during a run unwind it (:class:`Terminated`, ``KeyboardInterrupt``)
so that its temp files are removed, and are held off (:func:`signals_held`) where they would leave work half done."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""What stops a run; held off (:func:`signals_held`) where their exception would leave work half done: while the
workers are forked, while temp files are removed and while the outputs are published."""


class Terminated(SystemExit):
    """SIGTERM during :func:`packsft.packing.pipeline.run_pack`: unwinds so that every temp file is removed (exit
    code 143)."""


STOPS: list[int] = []
"""Stop signals received by :func:`_on_sigterm` / :func:`_on_sigint` during a run. Python prints and
drops an exception raised in a finalizer (``__del__``, e.g. one run by an import), so a signal handled there would
not stop the run: :func:`packsft.packing.publish.publish` checks this list before the point of no return."""


def _on_sigterm(signum, frame):
    STOPS.append(signum)
    raise Terminated(128 + signum)


def _on_sigint(signum, frame):
    STOPS.append(signum)
    raise KeyboardInterrupt


def restore_handler(signum: int, handler) -> None:
    """Put back ``handler`` (from ``signal.signal``); ``None``, a handler Python did not install, cannot be put
    back and becomes ``SIG_DFL``."""
    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def hold_sigterm() -> tuple[bool, Any, Any]:
    """Install :func:`_on_sigterm`, and :func:`_on_sigint` where SIGINT has Python's default handler (main thread
    only); return ``(installed, the SIGTERM handler replaced, the SIGINT one or None)``.

    Whatever SIGTERM had is replaced: a handler left by an earlier ``ray.init`` in this process (``sys.exit(15)``)
    or one Python cannot see (``signal.getsignal`` is ``None``) would end the run without removing its temps. An
    ignored SIGINT (a job started with ``&`` by a script) stays ignored.
    """
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        return False, None, None
    sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return True, previous, signal.signal(signal.SIGINT, _on_sigint) if sigint else None


@contextlib.contextmanager
def signals_held(signals: tuple[int, ...] = STOP_SIGNALS):
    """Hold ``signals`` off for the block, then act on one that came (its handler runs after the block; of two
    different ones, CPython runs the lower-numbered handler first: SIGINT's).

    Blocking them (``pthread_sigmask``) covers only this thread, and the kernel gives a signal sent to the process
    to any thread that does not block it (the packer has several: the tokenizer's, the pools'); CPython then runs
    the Python handler in the main thread all the same. So in the main thread the handlers are also swapped for
    one that only records the signal, which is raised again once the block has finished without an error.
    """
    got: list[int] = []
    swapped = {}
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            swapped[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # one pending on this thread goes to the recorder
        for s, handler in swapped.items():
            restore_handler(s, handler)
    if got:
        signal.raise_signal(got[0])  # to this thread: its handler (SIGTERM: exit 143) runs here


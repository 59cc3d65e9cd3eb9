"""Publishing a run's outputs as one unit: the writer lock, the stage test hook, the atomic swap of temp files over
the outputs through a roll-forward journal (:func:`publish`) and the finishing of one a killed run left
(:func:`finish_publish`)."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from packsft.io import FileLock, complete_publish, journal_path, lock_path, publish_files
from packsft.packing.config import HISTOGRAM_SUFFIX, PackError
from packsft.packing.signals import STOPS, Terminated, signals_held
from packsft.sidecar import REPORT_SUFFIX
from packsft.token_cache import cache_paths

STAGE_HOOK_ENV = "PACKSFT_PACK_STAGE_HOOK"
"""Test hook: ``STAGE:SIGNAL`` (e.g. ``rows_written:SIGKILL``) makes the packer send itself SIGNAL at STAGE."""
STAGES = ("tokenized", "rows_written", "sidecar_written", "report_written", "journal_written", "rows_published",
          "published")
"""The packer's publication stages, in order (see :func:`stage`)."""


class OutputLock(FileLock):
    """An exclusive ``flock`` on ``.NAME.lock`` beside the output: one packer per output at a time."""

    def __init__(self, output: str):
        super().__init__(lock_path(output))
        self.output = output

    def __enter__(self):
        try:
            return super().__enter__()
        except BlockingIOError as e:
            raise PackError(f"another packer is writing {self.output} (it holds {self.path}); wait for it or "
                            "pick another --output") from e


def stage(name: str) -> None:
    """Publication stage ``name`` (one of :data:`STAGES`) reached: the :data:`STAGE_HOOK_ENV` test hook."""
    hook = os.environ.get(STAGE_HOOK_ENV, "")
    stage, _, sig = hook.partition(":")
    if stage == name:
        os.kill(os.getpid(), getattr(signal, sig or "SIGKILL"))
        time.sleep(0.2)  # let an unblocked handler run here


def stale_outputs(paths: dict[str, str]) -> tuple[Path, ...]:
    """Files of an earlier run on the same output that this run's set (``paths``) does not replace: its token
    cache when this run writes none, and its report and histogram at their default paths when this run writes
    them elsewhere or not at all (they would describe the earlier rows)."""
    rows = paths["rows"]
    stale = [] if "token_cache" in paths else list(cache_paths(rows))
    for key, default in (("report", rows + REPORT_SUFFIX), ("histogram", rows + HISTOGRAM_SUFFIX)):
        if key not in paths or Path(paths[key]).resolve() != Path(default).resolve():
            stale.append(Path(default))
    written = {Path(p).resolve() for p in paths.values()}  # (--report X.lengths.png: a new output, not stale)
    return tuple(p for p in stale if p.resolve() not in written)


def finish_publish(journal: Path) -> None:
    """Finish the renames of a publish that a killed run left in ``journal`` (:func:`packsft.io.complete_publish`),
    under the writer lock.

    A journal with a rename that can no longer be done (its temp file and its output both gone: the set was
    deleted after the kill) is stale: there is nothing to finish, this run writes a whole new set, and the
    journal is removed.

    Raises:
        PackError: ``journal`` is not a publish journal (a hand-made file, a folder, not UTF-8, another format,
            relative paths) or a rename fails: one line naming it, saying to remove it.
        OSError: the disk is full (ENOSPC, EDQUOT: the CLI's own message).
    """
    try:
        complete_publish(journal)
    except FileNotFoundError:
        journal.unlink()
    except (OSError, ValueError) as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        if isinstance(e, UnicodeDecodeError):
            what = "not UTF-8 text, so not a packsft publish journal"
        elif isinstance(e, IsADirectoryError) and e.filename == str(journal):
            what = "a folder, not a packsft publish journal"
        elif isinstance(e, OSError):
            files = " -> ".join(str(f) for f in (e.filename, e.filename2) if f not in (None, str(journal)))
            what = f"{e.strerror or e}{f' ({files})' if files else ''}"
        else:
            what = str(e)
        hint = "" if "remove" in what else ("; a packer killed while publishing leaves this file, and this one "
                                               "cannot be finished: remove it and re-run the packer")
        raise PackError(f"{journal}: {what}{hint}") from None


def publish(paths: dict[str, str], temps: dict[str, Path]) -> None:
    """Rename the temp files over their outputs as one unit (:func:`packsft.io.publish_files`), the sidecar last,
    with SIGTERM and SIGINT held off (:func:`signals_held`).

    The files of an earlier run that this one does not replace (:func:`stale_outputs`) are removed in the same
    unit.
    """
    rows = Path(paths["rows"])

    def hook(final: Path | None) -> None:
        if final is None or final == rows:
            stage("journal_written" if final is None else "rows_published")

    journal = journal_path(paths["rows"])
    if STOPS:  # a stop signal whose exception a finalizer dropped: stop here, as the signal would have
        raise Terminated(128 + signal.SIGTERM) if signal.SIGTERM in STOPS else KeyboardInterrupt
    try:
        with signals_held():
            try:
                order = [k for k in ("histogram", "report", "token_index", "token_cache", "rows", "sidecar")
                         if k in temps]
                publish_files([(temps[k], Path(paths[k])) for k in order], journal, hook, stale_outputs(paths))
                temps.clear()
            except BaseException:
                if journal.exists():  # the temps belong to the journal: the next run or reader finishes the renames
                    temps.clear()
                raise
        stage("published")
    except (Terminated, KeyboardInterrupt) as e:  # held while publishing, raised after: the new set is out
        e.published = True
        raise

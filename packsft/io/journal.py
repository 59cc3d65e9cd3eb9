"""The publish journal: a set of files that must change together (a packed rows file and its sidecar) renamed as one
unit, finished by the next writer or reader after a kill; the writer's ``flock``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from packsft.io.files import atomic_open, fsync_dir

JOURNAL_FORMAT = "packsft-publish"


def journal_path(path: str | Path) -> Path:
    """The publish journal of a file set named after its main file ``path``: ``.NAME.publish.json`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.publish.json")


def lock_path(path: str | Path) -> Path:
    """The lock file of the writer of ``path``: ``.NAME.lock`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def publish_files(renames: list[tuple[Path, Path]], journal: Path,
                  after_rename: Callable[[Path | None], None] | None = None, removes: tuple[Path, ...] = ()) -> None:
    """Rename finished temp files over their destinations as one unit.

    The ``(temp, final)`` pairs are first written to ``journal`` (atomically, fsynced), then renamed in order,
    then the journal is removed. A process killed in between leaves the journal: :func:`complete_publish` (run
    by the next writer and by readers) finishes the renames, so readers see the old complete set or the new
    one. Every temp file must be complete and fsynced before this is called.

    Args:
        renames: ``(temp, final)`` pairs, each temp on the file system of its final path.
        journal: the journal path (:func:`journal_path` of the set's main file).
        after_rename: called with ``None`` once the journal is written, then with each final path once it is
            renamed (a test hook).
        removes: files of the old set that the new one does not have, removed (if present) before the renames.

    The journal records absolute paths: a reader finishing it may run in another folder.
    """
    renames = [(Path(os.path.abspath(t)), Path(os.path.abspath(f))) for t, f in renames]
    removes = tuple(Path(os.path.abspath(r)) for r in removes)
    record = {"format": JOURNAL_FORMAT, "version": 1, "renames": [[str(t), str(f)] for t, f in renames],
              "removes": [str(r) for r in removes]}
    with atomic_open(journal) as f:
        json.dump(record, f)
    folders = {Path(f).resolve().parent for _, f in renames} | {journal.resolve().parent}
    for folder in folders:
        fsync_dir(folder)
    if after_rename is not None:
        after_rename(None)
    for old in removes:
        Path(old).unlink(missing_ok=True)
    for tmp, final in renames:
        os.replace(tmp, final)
        if after_rename is not None:
            after_rename(Path(final))
    for folder in folders:
        fsync_dir(folder)
    journal.unlink()
    fsync_dir(journal.parent)


def complete_publish(journal: Path) -> bool:
    """Finish the renames of a :func:`publish_files` interrupted by a kill; ``True`` when ``journal`` existed.

    Idempotent: pairs whose temp file is gone were renamed already. Call it holding the set's writer lock
    (:class:`FileLock`), so that no writer publishes meanwhile.

    Raises:
        OSError: the journal is unreadable or not a publish journal (named in the message), or a rename fails.
    """
    try:
        text = journal.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    try:
        record = json.loads(text)
        pairs = [(Path(t), Path(f)) for t, f in record["renames"]] if record.get("format") == JOURNAL_FORMAT else None
        removes = [Path(r) for r in record.get("removes", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        pairs = None
    if pairs is None:
        problem = "not a packsft publish journal; remove it and re-run the writer"
    elif not all(p.is_absolute() for p in (*removes, *(q for pair in pairs for q in pair))):
        # relative to the folder its writer ran in, which is unknown here: renaming (or removing) them from this
        # process's folder would touch other files
        problem = ("publish journal with relative paths (written by an older packsft): run the writer again from the "
                   "folder it ran in, or remove the journal")
    elif foreign := _foreign_journal_paths(journal, pairs, removes):
        # a journal only ever names its set's temp files (beside their outputs) and its set's own stale files
        problem = (f"publish journal naming files outside its set ({foreign}): nothing was renamed or removed; "
                   "remove the journal and re-run the writer")
    else:
        problem = None
    if problem:
        raise OSError(errno.EINVAL, problem, str(journal))
    for old in removes:
        old.unlink(missing_ok=True)
    for tmp, final in pairs:
        try:
            os.replace(tmp, final)
        except FileNotFoundError:
            if not final.exists():
                raise
    for folder in {f.resolve().parent for _, f in pairs}:
        fsync_dir(folder)
    journal.unlink(missing_ok=True)
    fsync_dir(journal.parent)
    return True


def _foreign_journal_paths(journal: Path, pairs: list[tuple[Path, Path]], removes: list[Path]) -> str:
    """The first path of a journal that :func:`publish_files` would not have written, or ``""``: a temp that is not
    ``.FINAL.XXXXXXXX.tmp`` beside its final path, or a removed file outside the journal's folder or not named after
    its set's main file (``.NAME.publish.json`` -> ``NAME*``)."""
    main = journal.name[1:-len(".publish.json")] if journal.name.endswith(".publish.json") else None
    for tmp, final in pairs:
        if tmp.parent != final.parent or not (tmp.name.startswith(f".{final.name}.") and tmp.name.endswith(".tmp")):
            return str(tmp)
    for old in removes:
        if main is None or old.parent != journal.absolute().parent or not old.name.startswith(main):
            return str(old)
    return ""


_LOCK_FDS: set[int] = set()  # descriptors of the FileLocks this process holds


def _close_inherited_locks() -> None:
    """In a forked child: close its copies of the parent's lock descriptors (a copy would keep the ``flock``
    after the parent closes its own; closing the child's copy leaves the parent's lock as it is)."""
    for fd in _LOCK_FDS:
        with suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing), released on exit; entering raises
    ``BlockingIOError`` when another process holds it (callers that wait retry). A forked child (the packer's
    workers) does not keep it."""

    def __init__(self, path: str | Path):
        self.path, self._fd, self._pid = Path(path), None, None

    def __enter__(self) -> FileLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._pid = fd, os.getpid()
        _LOCK_FDS.add(fd)
        return self

    def __exit__(self, *exc) -> None:
        fd, self._fd = self._fd, None
        if self._pid != os.getpid():  # a forked child: its copy was closed at the fork
            return
        _LOCK_FDS.discard(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)  # released even where another process still has a copy of fd
        os.close(fd)


def finish_interrupted_publish(path: str | Path, timeout: float = 600.0) -> bool:
    """Complete the publish of ``path``'s file set if a killed writer left its journal; ``True`` if it did.

    Takes the writer's lock (:func:`lock_path`), waiting while a writer holds it and the journal is still
    there (a running writer finishes or recovers it itself).

    Raises:
        OSError: the folder is not writable (the message says what to run), or ``timeout`` seconds passed.
    """
    journal = journal_path(path)
    deadline = time.monotonic() + timeout
    while journal.exists():
        try:
            with FileLock(lock_path(path)):
                return complete_publish(journal)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(errno.ETIMEDOUT, f"a writer holds {lock_path(path)} and the publish journal stays",
                              str(journal)) from None
            time.sleep(0.05)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):  # not a folder it may not write
                raise
            raise OSError(e.errno, f"an interrupted write left {journal.name}, and this process cannot "
                          "finish it (read-only folder); re-run the writer where the folder is writable",
                          str(journal)) from e
    return False

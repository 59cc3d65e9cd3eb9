"""One trainer per run folder: rank 0 holds an exclusive ``flock`` on ``<logging.output_dir>/.packsft-train.lock``.

The lock (:class:`packsft.io.FileLock`) is held from before any checkpoint is read until the process ends; the file
names its holder (``pid <pid> on <host> since <UTC time>``) for the refusal of a second trainer. The kernel releases
an ``flock`` when its process dies, also on SIGKILL, so a killed trainer leaves no stale lock: its file still names
it, and the next trainer takes the lock over with a note. A trainer that ends normally empties the file.

Shared file systems: on NFS the Linux client emulates ``flock`` with byte-range locks (NLM for v3, built into v4),
which hold across clients; Lustre supports it only when mounted with ``-o flock`` (``localflock`` locks one node
only); BeeGFS and GPFS by their configuration. Where ``flock`` fails (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``, ...) the
trainer warns and runs unlocked: two trainers on one folder are then not detected.
"""

from __future__ import annotations

import atexit
import errno
import os
import socket
import sys
import time
from pathlib import Path

from packsft.io import FileLock

LOCK_FILE = ".packsft-train.lock"

_HELD: dict[Path, tuple[int, FileLock]] = {}   # lock file -> (pid, lock) of the locks this process holds


class RunFolderInUseError(ValueError):
    """Another trainer holds the run folder's lock (the message names the folder and the holder)."""


def lock_run_folder(output_dir: str | Path) -> Path | None:
    """Lock ``output_dir`` for this process until it ends (a second call for the same folder is a no-op).

    Returns:
        The lock file, or None where the file system does not support ``flock`` (a warning is printed).

    Raises:
        RunFolderInUseError: another process holds it: names the folder, the holder's pid and host and the lock
            file.
        OSError: the lock file cannot be created (the folder is checked to be writable before).
    """
    path = Path(output_dir) / LOCK_FILE
    key = path.resolve()
    held = _HELD.get(key)
    if held is not None and held[0] == os.getpid():
        return path
    lock = FileLock(path)
    try:
        lock.__enter__()
    except BlockingIOError:
        holder = _holder(path) or "another process (it has not written its pid yet)"
        raise RunFolderInUseError(
            f"logging.output_dir {output_dir} is in use by another trainer: {holder} holds {path}; wait for it to "
            "end (or stop it), or set logging.output_dir to another folder") from None
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR):
            raise
        print(f"warning: cannot lock {path} ({err.strerror or err}): this file system does not support flock, so a "
              "second trainer on this folder is not detected (docs/training.md, 'One trainer per run folder')",
              file=sys.stderr, flush=True)
        return None
    previous = _holder(path)
    if previous:
        print(f"note: {path} named {previous}, which ended without releasing it (killed?); this trainer takes it "
              "over", file=sys.stderr, flush=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n", encoding="utf-8")
    _HELD[key] = (os.getpid(), lock)
    atexit.register(_release, key)
    return path


def _holder(path: Path) -> str:
    """The holder the lock file names (``pid N on HOST since TIME``), '' when it names none."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""


def _release(key: Path) -> None:
    """Empty the lock file (its holder ended normally) and release the lock."""
    held = _HELD.pop(key, None)
    if held is None or held[0] != os.getpid():
        return
    try:
        os.truncate(key, 0)
    except OSError:
        pass
    held[1].__exit__(None, None, None)


def take_run_lock(output_dir: str | Path) -> str | None:
    """Lock ``output_dir`` on global rank 0 (the process group's rank, else ``RANK`` of the launcher: this runs before
    the process group exists); other ranks do nothing.

    Returns:
        The refusal (:class:`RunFolderInUseError`'s message) on rank 0 when another trainer holds the folder, else
        None: hand it to :func:`refuse_on_every_rank` once the process group exists.
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank != 0:
        return None
    try:
        lock_run_folder(output_dir)
    except RunFolderInUseError as err:
        return str(err)
    return None


def refuse_on_every_rank(refusal: str | None) -> None:
    """Raise rank 0's refusal (:func:`take_run_lock`) on every rank, so that all of them exit with it (none waits in
    a collective for a rank 0 that has gone). Collective over the default process group.

    Raises:
        RunFolderInUseError: on every rank, when rank 0 was refused.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal is not None:
        raise RunFolderInUseError(refusal)

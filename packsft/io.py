"""Atomic writes of files and folders: write beside the destination, then ``os.replace``.

A reader never sees a half-written file or folder, and a killed writer leaves the previous one intact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temp file beside ``path``; on clean exit fsync it and rename it over ``path``.

    Args:
        path: destination file; its folder is created if missing.
        mode: ``"w"`` (text) or ``"wb"`` (bytes).
        encoding: text encoding (ignored for binary mode).

    Yields:
        The open temp file. If the block raises, the temp file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def replace_dir(tmp: str | Path, final: str | Path) -> Path:
    """Publish the finished folder ``tmp`` as ``final`` (same file system) by renames.

    An existing ``final`` is first renamed aside, then ``tmp`` takes its name, then the old one is removed; a
    reader sees either the old or the new complete folder, never a mix.

    Returns:
        ``final`` as a ``Path``.
    """
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, old / final.name)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Create a temp folder beside ``path``; on clean exit publish it as ``path`` (:func:`replace_dir`).

    Yields:
        The temp folder to fill. If the block raises, it is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def temp_path(path: str | Path) -> Path:
    """Create an empty temp file beside ``path`` named like :func:`atomic_open`'s (``.NAME.XXXXXXXX.tmp``).

    The caller fills it and publishes it with ``os.replace`` (or removes it); :func:`remove_stale_temps`
    finds it after a kill.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    return Path(tmp)


def stale_temps(path: str | Path) -> list[Path]:
    """Temp files of ``path`` left by a killed writer: :func:`temp_path` / :func:`atomic_open` names, also nested.

    Only ``.NAME.XXXXXXXX.tmp`` (and ``..NAME.XXXXXXXX.tmp.YYYYYYYY.tmp``, an :func:`atomic_open` inside a temp
    name) match, so the temp files of other names (``NAME.idx``) are not touched.
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{{1,2}}{re.escape(path.name)}\.\w{{8}}\.tmp(\.\w{{8}}\.tmp)?$")
    folder = path.parent
    if not folder.is_dir():
        return []
    return sorted(folder / n for n in os.listdir(folder) if pattern.match(n))


class HashingWriter:
    """A binary file writer that counts and hashes (BLAKE2b, 20-byte digest) every byte written.

    Attributes:
        size: bytes written so far.
    """

    def __init__(self, f: IO[bytes]):
        self._f, self.size, self._h = f, 0, hashlib.blake2b(digest_size=20)

    def write(self, data: bytes) -> int:
        """Write ``data``; return its length."""
        self._f.write(data)
        self._h.update(data)
        self.size += len(data)
        return len(data)

    def hexdigest(self) -> str:
        """BLAKE2b-160 of the bytes written, 40 hex chars (what :func:`file_blake2b` gives for the file)."""
        return self._h.hexdigest()


def file_blake2b(path: str | Path, chunk: int = 1 << 22) -> str:
    """BLAKE2b-160 (40 hex chars) of a file's bytes, read in chunks (about 1 GB/s on one core)."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: str | Path) -> None:
    """fsync a folder so the renames in it survive a crash (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

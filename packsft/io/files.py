"""Atomic writes of files and folders (write beside the destination, then ``os.replace``), temp names, JSON reads,
BLAKE2b hashes.

A reader never sees a half-written file or folder, and a killed writer leaves the previous one intact.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import socket
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


def read_json_object(path: str | Path, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in the UTF-8 file ``path``.

    Raises:
        ``error`` (a ``ValueError``): naming the file: not valid JSON, or JSON that is not an object.
        OSError: the file cannot be read.
    """
    from packsft.jsonl import json_type

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a JSON {json_type(data)}, not an object")
    return data


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (see :func:`atomic_open`)."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def replace_dir(tmp: str | Path, final: str | Path) -> Path:
    """Publish the finished folder ``tmp`` as ``final`` (same file system) by renames.

    An existing ``final`` is swapped with ``tmp`` in one step where the kernel and file system can
    (:func:`exchange_paths`), then removed from ``tmp``'s name; elsewhere it is first renamed aside, then ``tmp``
    takes its name, then the old one is removed. A reader sees either the old or the new complete folder, never a
    mix; a crash between the two renames of the fallback leaves only ``.<name>.old-*``.

    Returns:
        ``final`` as a ``Path``.
    """
    tmp, final = Path(tmp), Path(final)
    if final.exists() and exchange_paths(tmp, final):
        if tmp.is_dir() and not tmp.is_symlink():  # the old folder, now under the temp name
            shutil.rmtree(tmp, ignore_errors=True)
        else:                                      # the old file or link itself, not what a link points to
            tmp.unlink(missing_ok=True)
        return final
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, old / final.name)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


_RENAME_EXCHANGE = 2   # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | Path, b: str | Path) -> bool:
    """Swap two existing paths atomically: ``renameat2(RENAME_EXCHANGE)`` (Linux >= 3.15, glibc >= 2.28; see
    https://man7.org/linux/man-pages/man2/rename.2.html).

    Returns:
        True when swapped; False, nothing changed, when the call fails: the C library, kernel or file system
        lacks it (some network and parallel file systems answer ``EINVAL``), or for any other reason, which the
        caller's plain renames then report.
    """
    import ctypes

    try:
        fn = ctypes.CDLL(None).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Create a temp folder beside ``path``; on clean exit publish it as ``path`` (:func:`replace_dir`).

    Every file and folder in it is fsynced before the rename (and ``path``'s parent after it), so a machine
    crash leaves the old folder (where :func:`replace_dir` cannot swap, possibly set aside as ``.<name>.old-*``)
    or the complete new one, not one of empty files.

    The temp folder is ``.<name>.tmp-<host>-<pid>-XXXXXXXX``: one a killed writer on this host left (its process
    is gone) is removed first. Its folders get ``0777 & ~umask`` and its files ``0666 & ~umask`` (0755 / 0644),
    whatever modes their writers gave them (``mkdtemp`` and safetensors create them private).

    Yields:
        The temp folder to fill. If the block raises, it is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, host = f".{path.name}.tmp-", socket.gethostname()
    for stale in path.parent.glob(f"{glob.escape(prefix)}*"):
        m = re.fullmatch(rf"{re.escape(prefix)}(.+)-(\d+)-\w+", stale.name)
        if m and m.group(1) == host and not _process_alive(int(m.group(2))) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{host}-{os.getpid()}-", dir=path.parent))
    try:
        yield tmp
        umask = _umask()
        for p in (tmp, *tmp.rglob("*")):
            if not p.is_symlink():
                os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)
        fsync_tree(tmp)
        replace_dir(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def foreign_entries(folder: str | Path, patterns: tuple[str, ...]) -> list[str]:
    """The entries of ``folder`` that are not files named by one of ``patterns`` (``fnmatch``, e.g.
    ``"model-*-of-*.safetensors"``), sorted: what replacing it by a new folder of those files would delete. A folder
    (or a link to one) is listed as ``name/``, also when its name matches."""
    from fnmatch import fnmatchcase

    return sorted(f"{p.name}/" if p.is_dir() else p.name for p in Path(folder).iterdir()
                  if p.is_dir() or not any(fnmatchcase(p.name, pat) for pat in patterns))


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def os_error_text(err: OSError) -> str:
    """``<file>: <what>`` (and `` -> <second file>`` for a rename) of an ``OSError``, for one ``error:`` line; its
    ``str()`` when it names no file."""
    if err.filename is None:
        return str(err)
    files = f"{err.filename} -> {err.filename2}" if err.filename2 is not None else str(err.filename)
    return f"{files}: {err.strerror or err}"


def check_writable_dir(folder: str | Path, name: str, error: type[Exception] = ValueError, hint: str = "") -> None:
    """Create ``folder`` if needed and write and remove a probe file in it.

    Raises:
        ``error``: ``"{name} {folder} is not writable ({reason}){hint}"``, the reason being ``"<path> is a file, not
        a folder"`` for a file in its path, else the OS error's text.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        reason = f"{blocker} is a file, not a folder" if blocker else err.strerror or str(err)
        raise error(f"{name} {folder} is not writable ({reason}){hint}") from None


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


def missing_file(what: str, path: str | Path) -> FileNotFoundError:
    """The error for a ``what`` file that ``path`` does not name: ``"<what> not found: <path>"``, or, when ``path``
    is a folder, ``"<what> <path> is a folder, not a file"``."""
    if Path(path).is_dir():
        return FileNotFoundError(f"{what} {path} is a folder, not a file")
    return FileNotFoundError(f"{what} not found: {path}")


def file_blake2b(path: str | Path, chunk: int = 1 << 22) -> str:
    """BLAKE2b-160 (40 hex chars) of a file's bytes, read in chunks (about 1 GB/s on one core)."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_tree(folder: str | Path) -> None:
    """fsync every regular file under ``folder``, then every folder in it (deepest first) and ``folder`` itself."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            file = os.path.join(root, name)
            if os.path.isfile(file) and not os.path.islink(file):
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(root)


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

"""Atomic file writes: a temp file in the destination folder, then ``os.replace``.

A reader never sees a half-written file, and a killed writer leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
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
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
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

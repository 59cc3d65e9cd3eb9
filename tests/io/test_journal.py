"""packsft.io's publish journal: several renames as one unit, finished after a kill by the next writer or reader."""

import errno
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from packsft.io import (
    FileLock,
    atomic_dir,
    complete_publish,
    finish_interrupted_publish,
    journal_path,
    lock_path,
    publish_files,
    temp_path,
)


class _Killed(Exception):
    pass


def _new_set(tmp_path, names=("rows", "rows.meta.json", "rows.report.json")):
    finals = [tmp_path / n for n in names]
    for f in finals:
        f.write_text(f"old {f.name}")
    temps = []
    for f in finals:
        t = temp_path(f)
        t.write_text(f"new {f.name}")
        temps.append(t)
    return list(zip(temps, finals))


def _contents(pairs):
    return [f.read_text() for _, f in pairs]


def test_publish_renames_all_and_removes_the_journal(tmp_path):
    pairs = _new_set(tmp_path)
    journal = journal_path(tmp_path / "rows")
    seen = []
    gone = tmp_path / "rows.old-cache"
    gone.write_text("of the old set only")
    publish_files(pairs, journal, seen.append, removes=(gone, tmp_path / "never-there"))
    assert _contents(pairs) == [f"new {f.name}" for _, f in pairs] and not gone.exists()
    assert seen == [None] + [f for _, f in pairs]  # the journal first, then each rename in order
    assert not journal.exists() and not any(t.exists() for t, _ in pairs)


@pytest.mark.parametrize("killed_after", [0, 1, 2])
def test_a_publish_killed_midway_is_finished_by_complete_publish(tmp_path, killed_after):
    pairs = _new_set(tmp_path)
    journal = journal_path(tmp_path / "rows")
    calls = []

    def kill(final):
        calls.append(final)
        if len(calls) == killed_after + 1:  # after the journal (call 1) and `killed_after` renames
            raise _Killed

    with pytest.raises(_Killed):
        publish_files(pairs, journal, kill)
    assert journal.exists()
    assert _contents(pairs)[killed_after:] == [f"old {f.name}" for _, f in pairs][killed_after:]  # a mix on disk
    assert complete_publish(journal) is True
    assert _contents(pairs) == [f"new {f.name}" for _, f in pairs]
    assert not journal.exists()
    assert complete_publish(journal) is False  # nothing left to do


def test_a_publish_of_relative_paths_is_finished_from_another_folder(tmp_path, monkeypatch):
    """The journal holds absolute paths: a reader in another folder renamed the new set into its own folder (and
    its ``removes`` would have deleted files there)."""
    (tmp_path / "run" / "out").mkdir(parents=True)
    (tmp_path / "elsewhere" / "out").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run")
    final, tmp = Path("out/rows"), Path("out/.rows.tmp")
    final.write_text("old")
    tmp.write_text("new")
    (tmp_path / "elsewhere" / "out" / "rows.stale").write_text("not of this set")
    journal = journal_path(tmp_path / "run" / "out" / "rows")

    def kill(final):
        raise _Killed

    with pytest.raises(_Killed):
        publish_files([(tmp, final)], journal, kill, removes=(Path("out/rows.stale"),))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert complete_publish(journal) is True
    assert (tmp_path / "run" / "out" / "rows").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "elsewhere" / "out").iterdir()) == ["rows.stale"]


def test_a_journal_with_relative_paths_is_refused(tmp_path):
    journal = journal_path(tmp_path / "rows")
    journal.write_text(json.dumps({"format": "packsft-publish", "version": 1, "renames": [[".rows.tmp", "rows"]]}))
    with pytest.raises(OSError, match="relative paths"):
        complete_publish(journal)


def test_a_journal_that_is_not_one_is_refused_by_name(tmp_path):
    journal = journal_path(tmp_path / "rows")
    journal.write_text(json.dumps({"renames": [["a", "b"]]}))
    with pytest.raises(OSError, match=r"not a packsft publish journal.*\.rows\.publish\.json"):
        complete_publish(journal)


def test_a_pair_with_neither_file_is_an_error(tmp_path):
    journal = journal_path(tmp_path / "rows")
    journal.write_text(json.dumps({"format": "packsft-publish", "version": 1,
                                   "renames": [[str(tmp_path / ".gone.tmp"), str(tmp_path / "gone")]]}))
    with pytest.raises(FileNotFoundError):
        complete_publish(journal)


def _hold_lock(path, ready, seconds):
    with FileLock(path):
        ready.set()
        time.sleep(seconds)


def test_a_reader_waits_for_the_writer_lock_then_finishes_the_publish(tmp_path):
    pairs = _new_set(tmp_path)
    rows = tmp_path / "rows"
    journal = journal_path(rows)
    with pytest.raises(_Killed):
        publish_files(pairs, journal, lambda final: (_ for _ in ()).throw(_Killed()) if final is not None else None)
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(lock_path(rows), ready, 1.0))
    holder.start()
    assert ready.wait(30)
    t0 = time.monotonic()
    assert finish_interrupted_publish(rows) is True
    assert time.monotonic() - t0 > 0.5  # it waited for the lock (the holder keeps it for 1 s)
    holder.join(30)
    assert _contents(pairs) == [f"new {f.name}" for _, f in pairs]
    assert finish_interrupted_publish(rows) is False


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only folders")
def test_a_reader_that_cannot_write_the_folder_says_so(tmp_path):
    pairs = _new_set(tmp_path)
    rows = tmp_path / "rows"
    with pytest.raises(_Killed):
        publish_files(pairs, journal_path(rows), lambda final: (_ for _ in ()).throw(_Killed()) if final else None)
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(OSError, match="cannot finish it"):
            finish_interrupted_publish(rows)
    finally:
        os.chmod(tmp_path, 0o755)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_reader_on_a_read_only_mount_says_so(tmp_path, monkeypatch, code):
    """A read-only mount fails the lock with EROFS (not a PermissionError): the same message, whoever runs it."""
    import packsft.io.journal

    pairs = _new_set(tmp_path)
    rows = tmp_path / "rows"
    with pytest.raises(_Killed):
        publish_files(pairs, journal_path(rows), lambda final: (_ for _ in ()).throw(_Killed()) if final else None)

    class ReadOnly:
        def __init__(self, path):
            raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(packsft.io.journal, "FileLock", ReadOnly)
    with pytest.raises(OSError, match="cannot finish it") as info:
        finish_interrupted_publish(rows)
    assert info.value.errno == code


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """The packer's forked workers (or another run's, in the same process) must not hold its output lock."""
    path = tmp_path / ".rows.lock"
    with FileLock(path):
        pid = os.fork()
        if pid == 0:  # the child outlives the parent's lock
            time.sleep(2)
            os._exit(0)
    try:
        with FileLock(path):  # free again although the child still runs
            assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.waitpid(pid, 0)


def test_atomic_dir_fsyncs_every_file_and_folder_before_publishing(tmp_path, monkeypatch):
    """A machine crash after the rename must not leave a complete-looking folder of empty files (an HF export)."""
    import packsft.io.files as io_module

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(io_module.os, "fsync",
                        lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    with io_module.atomic_dir(tmp_path / "out") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "config.json").write_text("{}")
    names = [os.path.relpath(p, tmp_path) for p in synced]
    inside = [os.path.relpath(n, tmp.name) for n in names[:-1]]                       # before the rename
    assert sorted(inside) == [".", "model.safetensors", "sub", "sub/config.json"], names
    assert names[-1] == "." and (tmp_path / "out" / "sub" / "config.json").read_text() == "{}"   # then the parent


def test_atomic_dir_gives_its_files_the_usual_modes(tmp_path):
    """A PEFT adapter folder held adapter_model.safetensors as 0600 (safetensors writes it private); an HF export
    chmod'ed its own files, nothing else did."""
    umask = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            for name in ("private", "sub/private"):
                fd = os.open(tmp / name, os.O_CREAT | os.O_WRONLY, 0o600)
                os.close(fd)
    finally:
        os.umask(umask)
    out = tmp_path / "out"
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in (out, *out.rglob("*"))}
    assert modes == {".": 0o755, "private": 0o644, "sub": 0o755, "sub/private": 0o644}


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "fallback"])
def test_replace_dir_publishes_the_new_folder_and_removes_the_old(tmp_path, monkeypatch, swap):
    """Where renameat2(RENAME_EXCHANGE) works the old folder is never renamed aside: no crash leaves it as the only
    copy under another name; elsewhere (``swap`` False) the rename-aside fallback gives the same result."""
    import packsft.io.files as io_module

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "old.txt").write_text("old")
    new = tmp_path / ".ckpt.tmp"
    new.mkdir()
    (new / "new.txt").write_text("new")
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(io_module.os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b))[1])
    if not swap:
        monkeypatch.setattr(io_module, "exchange_paths", lambda a, b: False)
    elif not io_module.exchange_paths(tmp_path / "ckpt", tmp_path / "ckpt"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system")
    assert io_module.replace_dir(new, tmp_path / "ckpt") == tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["new.txt"]
    assert len(renames) == (0 if swap else 2)
    io_module.replace_dir(_folder(tmp_path / ".other"), tmp_path / "fresh")       # nothing to replace: one rename
    assert (tmp_path / "fresh").is_dir() and not (tmp_path / ".other").exists()
    (tmp_path / "link").symlink_to(tmp_path / "fresh")     # a link is replaced, what it points to is kept
    io_module.replace_dir(_folder(tmp_path / ".third"), tmp_path / "link")
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "fresh").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "fresh", "link"]


def _folder(path):
    path.mkdir()
    return path


def test_exchange_paths_swaps_and_changes_nothing_when_it_fails(tmp_path):
    from packsft.io import exchange_paths

    (tmp_path / "a").write_text("a")
    (tmp_path / "b").mkdir()
    if not exchange_paths(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this file system")
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").read_text() == "a"
    assert not exchange_paths(tmp_path / "a", tmp_path / "missing")      # the caller's os.replace reports it
    assert (tmp_path / "a").is_dir() and not (tmp_path / "missing").exists()


def test_atomic_dir_removes_the_temp_folder_of_a_killed_writer_on_this_host(tmp_path):
    """A killed export left ``.out.tmp-XXXXXXXX`` (143 MB in one report) that no later run removed."""
    import socket
    import subprocess
    import sys

    import packsft.io.files as io_module

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # a process that has exited
    host = socket.gethostname()
    killed = tmp_path / f".out.tmp-{host}-{dead}-abcd1234"
    running = tmp_path / f".out.tmp-{host}-{os.getpid()}-efgh5678"  # a live writer (here: this process)
    elsewhere = tmp_path / f".out.tmp-other-host-{dead}-ijkl9012"  # another node on a shared file system
    other_name = tmp_path / f".outer.tmp-{host}-{dead}-mnop3456"
    for d in (killed, running, elsewhere, other_name):
        (d / "sub").mkdir(parents=True)
    with io_module.atomic_dir(tmp_path / "out") as tmp:
        assert tmp.name.startswith(f".out.tmp-{host}-{os.getpid()}-")
        (tmp / "f").write_text("x")
    assert (tmp_path / "out" / "f").read_text() == "x"
    assert not killed.exists() and running.is_dir() and elsewhere.is_dir() and other_name.is_dir()

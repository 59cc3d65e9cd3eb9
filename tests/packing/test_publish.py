"""The packer's outputs as a set: killed at every stage, a re-pack leaves the old set or the new one, never a mix
the loader accepts; the sidecar's rows size and hash; stale temps; same input and output; progress."""

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from tqdm import tqdm

from packsft.data.dataset import PackedSFTDataset
from packsft.io import journal_path, stale_temps
from packsft.packing import cli
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.packing.publish import STAGE_HOOK_ENV, STAGES
from packsft.sidecar import SidecarError, read_sidecar, sidecar_path
from packsft.token_cache import cache_paths

TOK = "smollm2-135m-instruct"


def _chats(path: Path, n: int = 24) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"question {i}: " + "why " * (i * 3 % 40)},
                    {"role": "assistant", "content": f"answer {i} " + "because " * (i * 5 % 30)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def _argv(src, out, tok, L):
    return ["--input", str(src), "--output", str(out), "--tokenizer", str(tok), "--max-seq-length", str(L),
            "--no-progress"]


def _child(argv, hook, foreign_handler=False, err=None):
    os.environ[STAGE_HOOK_ENV] = hook
    if err is not None:
        sys.stderr = open(err, "w", buffering=1)
    # another thread, as in a real packer (tokenizer, pools): the kernel may give it a signal sent to the process
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    if foreign_handler:  # what ray.init leaves in a process (and so in a process forked from it)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    raise SystemExit(cli.main(argv))


def _set(out: Path) -> dict[str, bytes]:
    """The rows, sidecar and token cache bytes, and the report's record of the rows (its other fields name the
    paths)."""
    got = {p.name: p.read_bytes() for p in (out, sidecar_path(out), *cache_paths(out)) if p.exists()}
    report = Path(str(out) + ".report.json")
    got["report.rows_file"] = json.loads(report.read_text())["rows_file"] if report.exists() else None
    return got


@pytest.fixture(scope="module")
def packed_sets(tmp_path_factory, tokenizer_dir):
    """The old set (L=128) and the new set (L=256) of the same input, packed cleanly."""
    d = tmp_path_factory.mktemp("sets")
    src = _chats(d / "in.jsonl")
    tok = tokenizer_dir(TOK)
    sets = {}
    for L in (128, 256):
        out = d / f"ref{L}" / "rows.jsonl.packed"
        assert cli.main(_argv(src, out, tok, L)) == 0
        sets[L] = _set(out)
    return src, tok, sets


def _load(out: Path, tok):
    meta = read_sidecar(out)
    return PackedSFTDataset(out, tok, "chat-template", meta["max_seq_len"], verify_rows_hash=True)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_repack_killed_at_every_stage_leaves_the_old_or_the_new_set(tmp_path, packed_sets, sig):
    src, tok, sets = packed_sets
    ctx = mp.get_context("fork")
    out = tmp_path / "set" / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0  # the old set, packed once and put back before each stage
    old = shutil.copytree(out.parent, tmp_path / "old")  # every file of the folder, mtimes kept
    for stage in STAGES:
        shutil.rmtree(out.parent)
        shutil.copytree(old, out.parent)
        err = tmp_path / f"{stage}.err"
        p = ctx.Process(target=_child, args=(_argv(src, out, tok, 256), f"{stage}:{sig}", False, err))
        p.start()
        p.join(120)
        code = p.exitcode
        assert code in ((-signal.SIGKILL,) if sig == "SIGKILL" else (128 + signal.SIGTERM,)), (stage, code)
        journal = journal_path(out)
        assert journal.exists() == (sig == "SIGKILL" and stage in ("journal_written", "rows_published")), stage
        if sig == "SIGTERM":
            leftovers = [t for final in (out, sidecar_path(out), Path(str(out) + ".report.json"),
                                         Path(str(out) + ".lengths.png"), journal, *cache_paths(out))
                         for t in stale_temps(final)]
            assert leftovers == [], (stage, leftovers)  # SIGTERM removes its own temp files
        # a reader sees the old complete set or the new one: killed once the journal is written, the new one
        new = stage in ("journal_written", "rows_published", "published")
        if sig == "SIGTERM":  # and the message says which
            assert err.read_text().startswith("error: terminated (SIGTERM); " + (
                "it came while the outputs were published: the new ones are complete and in place" if new else
                "this run's temp files are removed")), (stage, err.read_text())
        ds = _load(out, tok)  # finishes an interrupted publish first
        assert not journal.exists()
        assert ds.max_seq_len == (256 if new else 128) and ds.rows_hash_checked, (stage, sig)
        assert ds.token_cache is not None and "hash checked" in ds.token_cache_status
        ds[0]
        assert _set(out) == sets[256 if new else 128], (stage, sig)  # rows, cache, sidecar, report's rows record
        # the next run removes what a SIGKILL left and publishes the new set
        assert cli.main(_argv(src, out, tok, 256)) == 0
        assert [t for final in (out, sidecar_path(out), *cache_paths(out)) for t in stale_temps(final)] == []
        assert _set(out) == sets[256]


def test_sigterm_is_the_packers_own_even_under_a_handler_left_by_ray(tmp_path, packed_sets):
    """A handler installed before the packer starts (``ray.init`` leaves ``sys.exit(15)``) is replaced while it
    runs: SIGTERM still removes the run's temps and exits 143, and the handler is back afterwards."""
    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0
    p = mp.get_context("fork").Process(target=_child, args=(_argv(src, out, tok, 256), "rows_written:SIGTERM", True))
    p.start()
    p.join(120)
    assert p.exitcode == 128 + signal.SIGTERM
    assert [t for final in (out, sidecar_path(out), *cache_paths(out)) for t in stale_temps(final)] == []
    assert _set(out) == sets[128]
    mine = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert cli.main(_argv(src, out, tok, 256)) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, mine)


def test_stale_temps_of_a_killed_run_are_removed_and_others_kept(tmp_path, packed_sets):
    src, tok, _ = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    stale = [tmp_path / ".rows.jsonl.packed.abcd1234.tmp", tmp_path / ".rows.jsonl.packed.meta.json.x_y_z_12.tmp",
             tmp_path / "..rows.jsonl.packed.lengths.png.abcdefgh.tmp.ijklmnop.tmp"]
    other = [tmp_path / ".rows.jsonl.packed.idx.abcd1234.tmp", tmp_path / ".other.jsonl.abcd1234.tmp"]
    for p in stale + other:
        p.write_bytes(b"x" * 1000)
    assert cli.main(_argv(src, out, tok, 128)) == 0
    assert [p for p in stale if p.exists()] == []
    assert all(p.exists() for p in other)


def test_a_full_disk_is_an_error_line_and_leaves_the_old_set(tmp_path, packed_sets, monkeypatch, capsys):
    """ENOSPC while the spools are written (a real disk is not filled here: the write raises as one would)."""
    import errno

    from packsft.packing import worker

    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0
    before = sorted(p.name for p in tmp_path.iterdir())

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(worker, "encode_runs", full)
    capsys.readouterr()
    assert cli.main(_argv(src, out, tok, 256)) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {os.strerror(errno.ENOSPC)} in {tmp_path.resolve()} while packing {out}: free space there, "
                   "or write the outputs (--output, --report, --histogram) to a larger disk; this run's temp files are "
                   "removed and none of its outputs was published\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == before and _set(out) == sets[128]
    report = tmp_path / "reports" / "r.json"   # a failed write names no file: every folder written is named
    assert cli.main([*_argv(src, tmp_path / "o2.jsonl.packed", tok, 256), "--report", str(report)]) == 2
    assert f" in {tmp_path.resolve()} or {report.parent.resolve()} while packing" in capsys.readouterr().err


def test_loader_refuses_rows_that_are_not_the_sidecars(tmp_path, packed_sets):
    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0
    meta = read_sidecar(out)
    assert meta["rows_file"]["size"] == out.stat().st_size and len(meta["rows_file"]["blake2b"]) == 40
    report = json.loads(Path(str(out) + ".report.json").read_text())
    assert report["rows_file"] == meta["rows_file"]
    data = out.read_bytes()
    out.write_bytes(data + b"\n")  # another size: always refused
    with pytest.raises(SidecarError, match=r"rows.jsonl.packed does not match its sidecar .*rows.jsonl.packed"
                                           r".meta.json: the rows file has \d+ bytes, the sidecar records \d+"):
        PackedSFTDataset(out, tok, "chat-template", 128, verify_rows_hash=False)
    k = data.index(b"question 3") + len("question ")
    out.write_bytes(data[:k] + b"4" + data[k + 1:])  # same size, other bytes: refused by the hash
    with pytest.raises(SidecarError, match=r"BLAKE2b is [0-9a-f]{40}, the sidecar records [0-9a-f]{40}"):
        PackedSFTDataset(out, tok, "chat-template", 128)  # default: hashed (the file is small)
    ds = PackedSFTDataset(out, tok, "chat-template", 128, verify_rows_hash=False)  # size only, on request
    assert not ds.rows_hash_checked


def test_same_path_for_input_and_output_is_refused(tmp_path, packed_sets, capsys):
    src, tok, _ = packed_sets
    copy = tmp_path / "in.jsonl"
    copy.write_bytes(Path(src).read_bytes())
    before = copy.read_bytes()
    for extra in ([], ["--report", str(copy)]):
        target = copy if not extra else tmp_path / "o.jsonl.packed"
        assert cli.main(_argv(copy, target, tok, 128) + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --input") and "would overwrite its own input" in err
    assert copy.read_bytes() == before
    link = tmp_path / "link.jsonl"
    link.symlink_to(copy)
    assert cli.main(_argv(link, copy, tok, 128)) == 2
    assert copy.read_bytes() == before


def test_progress_counts_bytes_with_a_total(tmp_path, packed_sets, capsys):
    src, tok, _ = packed_sets
    run_pack(PackConfig(inputs=[str(src)], output=str(tmp_path / "p.jsonl.packed"), tokenizer=str(tok),
                        max_seq_len=128, histogram="", progress=True))
    err = capsys.readouterr().err
    total = Path(src).stat().st_size
    size = tqdm.format_sizeof(total)
    assert "reading: 100%" in err and f"{size}/{size}" in err and "<00:00" in err, err[-300:]


@pytest.mark.parametrize("stray", ["text", "json", "not_utf8", "folder", "relative"])
def test_a_stray_publish_journal_is_one_error_line_naming_it(tmp_path, packed_sets, capsys, stray):
    """A file at the journal's name that is not a journal packsft can finish (hand-made, or damaged): one error
    line naming it, exit 2, the set beside it untouched (was a traceback, or an unnamed UnicodeDecodeError)."""
    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0
    journal = journal_path(out)
    if stray == "folder":
        journal.mkdir()
    else:
        journal.write_bytes({"text": b"notes", "json": b'{"renames": 3}', "not_utf8": b"\xff\xfe{",
                             "relative": json.dumps({"format": "packsft-publish", "version": 1,
                                                     "renames": [[".rows.tmp", "rows"]]}).encode()}[stray])
    capsys.readouterr()
    assert cli.main(_argv(src, out, tok, 256)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {journal}: ") and err.count("\n") == 1 and "remove" in err, err
    assert journal.exists() and _set(out) == sets[128]


@pytest.mark.parametrize("entry", ["removes", "renames", "renames_tmp_elsewhere"])
def test_a_journal_naming_files_outside_its_set_touches_nothing(tmp_path, packed_sets, capsys, entry):
    """A hand-made journal cannot make the packer delete or overwrite other files: it only ever finishes renames of
    its set's temp files (``.FINAL.XXXXXXXX.tmp`` beside FINAL) and removes its set's own files (was: whatever the
    journal named, anywhere)."""
    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    assert cli.main(_argv(src, out, tok, 128)) == 0
    victims = tmp_path / "elsewhere"
    victims.mkdir()
    (victims / "notes.txt").write_text("keep me")
    (victims / ".notes.txt.abcd1234.tmp").write_text("overwrite")
    record = {"format": "packsft-publish", "version": 1, "removes": [], "renames": []}
    if entry == "removes":
        record["removes"] = [str(victims / "notes.txt")]
    elif entry == "renames":
        record["renames"] = [[str(victims / "notes.txt"), str(victims / "notes.jsonl")]]   # not a temp name
    else:
        record["renames"] = [[str(victims / ".notes.txt.abcd1234.tmp"), str(tmp_path / "notes.txt")]]
    journal = journal_path(out)
    journal.write_text(json.dumps(record))
    capsys.readouterr()
    assert cli.main(_argv(src, out, tok, 256)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {journal}: ") and "outside its set" in err and err.count("\n") == 1, err
    assert (victims / "notes.txt").read_text() == "keep me" and not (tmp_path / "notes.txt").exists()
    assert not (victims / "notes.jsonl").exists()
    assert _set(out) == sets[128]


def test_a_journal_whose_set_was_deleted_since_is_stale_and_removed(tmp_path, packed_sets):
    """A run killed while publishing, whose folder was then emptied of its (visible) files: the journal's renames
    cannot be finished (their temp files and outputs are gone), so it is stale; the next run packs anew."""
    src, tok, sets = packed_sets
    out = tmp_path / "rows.jsonl.packed"
    journal = journal_path(out)
    journal.write_text(json.dumps({"format": "packsft-publish", "version": 1, "removes": [],
                                   "renames": [[str(tmp_path / ".rows.jsonl.packed.abcd1234.tmp"), str(out)]]}))
    assert cli.main(_argv(src, out, tok, 128)) == 0
    assert not journal.exists() and _set(out) == sets[128]

"""Pack inputs other than JSONL: Hugging Face datasets saved on disk, Parquet and Arrow files, read row by row;
Energon datasets, read sample by sample.

An ``--input`` is one of:

* a JSONL file (any other name): read by :func:`packsft.conversation.iter_jsonl_lines_sized`, located by
  1-based line (``data.jsonl:17``);
* a folder written by ``datasets.Dataset.save_to_disk`` (``state.json`` + ``data-*.arrow``), or by
  ``DatasetDict.save_to_disk`` (``dataset_dict.json``: ``split`` picks one, e.g. ``train``);
* a ``.parquet`` file, or an ``.arrow`` file (Arrow IPC stream, as ``datasets`` writes, or IPC file/Feather v2);
* a folder prepared by ``energon prepare`` (``.nv-meta/``): ``split`` picks one of its ``split.yaml`` splits
  (``train`` when not given), read by :mod:`packsft.packing.energon` with the ``packsft[energon]`` extra, each
  sample's ``json`` record located by shard and sample key (``shard-000001.tar: sample 000017``; report entries
  carry ``shard`` and ``sample``). A sample with media or a non-text content part is rejected with its reason.

The last four are *row sources*. The three others need the ``packsft[datasets]`` extra (``datasets`` and
``pyarrow``, imported only when such an input is given), are read one Arrow record batch at a time (a folder
through ``datasets.load_from_disk``, memory-mapped; Parquet through ``pyarrow.parquet.ParquetFile.iter_batches``
without pre-buffering, so at most about one row group's columns are in memory), and are located by 0-based row
index (``train.parquet: row 17``, what ``dataset[17]`` returns) in every message and report entry (key ``row``
instead of ``line``).

Each row becomes the JSON text of its record dict, so the rest of the packer (``--format``, ``--adapter``,
validation, ``--max-conversation-bytes`` on the record's UTF-8 JSON size) treats it exactly like a JSONL line.
Arrow gives every row of a column all the fields of its struct type (a message without ``tool_calls`` reads
back with ``tool_calls: null``), so keys whose value is null are dropped from every object, at any depth,
except the ``content`` of a message (an object with a ``role``: null on an assistant turn with tool calls). Key
order follows the Arrow schema (first seen), so rows may differ from a JSONL of the same records in key order,
not in content. Dates and times become ISO strings, decimals numbers, UTF-8 bytes strings; a row holding other
binary data is rejected.
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packsft.extras import import_extra
from packsft.io import file_blake2b
from packsft.jsonl import iter_jsonl_lines_sized
from packsft.packing import energon
from packsft.packing.energon import is_energon

ROW_SUFFIXES = (".parquet", ".arrow")
_ROWS_PER_BATCH = 64


class SourceError(ValueError):
    """An input that cannot be read as a row source (the message names the file and, where known, the row)."""


def is_row_source(path: str | Path) -> bool:
    """True for a folder or a ``.parquet`` / ``.arrow`` file (located by row), False for JSONL (by line)."""
    p = Path(path)
    return p.is_dir() or p.suffix.lower() in ROW_SUFFIXES


def position(path: str | Path, number: int) -> dict[str, int | str]:
    """``{"row": number}`` for a row source, ``{"line": number}`` for JSONL, ``{"shard", "sample"}`` (the key) for
    an Energon dataset's sample ``number``: the location keys of report entries."""
    if is_energon(path):
        shard, key = energon.locate(path, number)
        return {"shard": shard, "sample": key}
    return {"row": number} if is_row_source(path) else {"line": number}


def where(path: str | Path, number: int) -> str:
    """``path: row N`` for a row source, ``path: SHARD: sample KEY`` for an Energon dataset, ``path:N`` for JSONL
    (the prefix of errors and warnings)."""
    return entry_where({"input": path, **position(path, number)})


def entry_where(entry: dict[str, Any]) -> str:
    """:func:`where` for a report entry ``{"input", "line" | "row" | "shard" and "sample", ...}``."""
    if "sample" in entry:
        return f"{entry['input']}: {entry['shard']}: sample {entry['sample']}"
    return f"{entry['input']}: row {entry['row']}" if "row" in entry else f"{entry['input']}:{entry['line']}"


def count_word(paths: list[str]) -> str:
    """``line``, ``row``, ``sample`` or several joined by ``/``: what the inputs' records are called in a count."""
    kinds = {"sample" if is_energon(p) else "row" if is_row_source(p) else "line" for p in paths}
    return "/".join(k for k in ("line", "row", "sample") if k in kinds)


def _import(module: str):
    if module.startswith("megatron.energon"):
        return import_extra(module, "energon", "reading Energon datasets", SourceError)
    return import_extra(module, "datasets", "reading Parquet/Arrow files and datasets.save_to_disk folders",
                        SourceError)


def _dataset_dir(path: Path, split: str | None) -> Path:
    """The ``Dataset`` folder of ``path`` (a ``DatasetDict`` folder's ``split`` subfolder).

    Raises:
        SourceError: not a ``save_to_disk`` folder, a ``DatasetDict`` without ``split``, or an unknown split.
    """
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (ValueError, KeyError, TypeError) as err:
            raise SourceError(f"{path}/dataset_dict.json: not a datasets DatasetDict index ({err})") from err
        path = path / _choose_split(path, "a DatasetDict", list(map(str, splits)), split)
    if not (path / "state.json").is_file():
        raise SourceError(f"--input {path} is a folder without state.json or dataset_dict.json: not written by "
                          "datasets' save_to_disk; pass JSONL, .parquet or .arrow files, a save_to_disk folder or an "
                          "Energon dataset folder")
    return path


def _choose_split(path: Path | str, what: str, splits: list[str], split: str | None, default: str | None = None
                  ) -> str:
    """``split``, or ``default`` when not given, of a ``path`` with ``splits`` (``what`` it is, for the message).

    Raises:
        SourceError: no ``split`` given and no ``default`` among ``splits``, or ``split`` not among them (named).
    """
    listed = ", ".join(splits) or "none"
    if split is None and default not in splits:
        raise SourceError(f"--input {path} is {what} (splits: {listed}): pick one with --split NAME")
    name = default if split is None else split
    if name not in splits:
        raise SourceError(f"--split {split!r}: {path} has splits {listed}")
    return name


def _split_folder(path: Path, split: str | None) -> Path:
    """The ``Dataset`` folder of a folder input that passed :func:`check_source`: ``path``, or its ``split``."""
    return path / split if is_dataset_dict(path) else path


def is_dataset_dict(path: str | Path) -> bool:
    """True for a folder written by ``DatasetDict.save_to_disk`` (it has ``dataset_dict.json``)."""
    return (Path(path) / "dataset_dict.json").is_file()


def takes_split(path: str | Path) -> bool:
    """True for an input ``--split`` applies to: a ``DatasetDict`` folder or an Energon dataset."""
    return is_dataset_dict(path) or is_energon(path)


def energon_split(path: str | Path, split: str | None) -> str:
    """The split to read of an Energon dataset: ``split``, or ``train`` when not given.

    Raises:
        SourceError: the extra is missing, ``split.yaml`` cannot be read, the split is unknown or has no shards
            (the message names the splits that have), energon cannot read the split's metadata, or a shard is not
            the file ``energon prepare`` indexed (:func:`packsft.packing.energon.changed_shard`).
    """
    _import("megatron.energon")
    try:
        splits = energon.split_names(path)
    except Exception as err:  # noqa: BLE001 - missing or malformed split file, in energon's words
        raise SourceError(f"--input {path}: an Energon dataset folder (.nv-meta) whose split.yaml cannot be read "
                          f"({type(err).__name__}: {err}); prepare it with energon prepare {path}") from err
    name = _choose_split(path, "an Energon dataset without a train split", [s for s, n in splits.items() if n],
                         split, default="train")
    try:
        changed = energon.changed_shard(path, name)
    except Exception as err:  # noqa: BLE001 - a missing .info.json, shard count or shard, an emptied split
        raise SourceError(f"--input {path}: split {name!r} cannot be read as an Energon dataset "
                          f"({type(err).__name__}: {err})") from err
    if changed:
        raise SourceError(f"--input {path}: {changed}; run energon prepare {path} again")
    return name


def check_source(path: str | Path, split: str | None = None) -> None:
    """Check that ``path`` exists and can be read (the libraries a row source needs are importable).

    Raises:
        SourceError: no such file (or a broken link), not a regular file (a pipe), a part of an Energon dataset
            (naming the dataset's folder), a folder that is not a ``save_to_disk`` folder, a ``DatasetDict`` folder
            without ``split`` (the message names its splits), the ``packsft[datasets]`` extra missing, or an
            Energon dataset :func:`energon_split` refuses.
    """
    p = Path(path)
    if is_energon(p):
        energon_split(p, split)
    elif (p.is_dir() or p.suffix == ".tar") and (root := energon.dataset_above(p)) is not None:
        raise SourceError(f"--input {path}: part of the Energon dataset {root}; give the dataset's folder, "
                          f"--input {root}")
    elif p.is_dir():
        _dataset_dir(p, split)
        _import("datasets")
    elif p.is_file():
        if is_row_source(p):
            _import("pyarrow")
        else:
            _check_not_binary(p)
    elif p.exists() or str(path) == "-":  # a pipe, /dev/stdin, a device; standard input
        what = "not a regular file (a pipe or a device)" if p.exists() else "standard input is not read"
        raise SourceError(f"--input {path}: {what}; the packer reads its inputs at byte offsets, so write the "
                          "stream to a file first")
    else:  # nothing there
        raise SourceError(f"--input {path}: " + (f"a broken symbolic link (to {os.readlink(p)}: missing, or a loop)"
                                                  if p.is_symlink() else "no such file"))


_MAGIC = ((b"\x1f\x8b", "gzip-compressed", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "zstd -d"),
          (b"\xfd7zXZ\x00", "xz-compressed", "xz -dk"), (b"BZh", "bzip2-compressed", "bunzip2 -k"),
          (b"PK\x03\x04", "a zip archive", "unzip"), (b"PAR1", "a Parquet file", None),
          (b"ARROW1", "an Arrow IPC file", None), (b"\xff\xff\xff\xff", "an Arrow IPC stream", None))


def _check_not_binary(path: Path) -> None:
    """Refuse a JSONL input that starts as a compressed, columnar or tar file (its bytes would be read as lines).

    Raises:
        SourceError: naming the kind and what to do.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return  # reading it reports the error with its line
    if head[257:262] == b"ustar":
        raise SourceError(f"--input {path}: a tar archive, not JSONL text; to read WebDataset shards, prepare their "
                          f"folder with energon prepare, then give that folder")
    for magic, kind, command in _MAGIC:
        if head.startswith(magic) and (magic != b"BZh" or head[3:4].isdigit()):
            fix = (f"decompress it first ({command} {path})" if command else
                   f"name it {'.parquet' if 'Parquet' in kind else '.arrow'} to read it by rows")
            raise SourceError(f"--input {path}: {kind}, not JSONL text (the packer reads JSONL at byte offsets): "
                              f"{fix}")


def input_bytes(paths: list[str]) -> int | None:
    """Total bytes of JSONL inputs (the progress bar's total), None when a row source is among them."""
    if any(is_row_source(p) for p in paths):
        return None
    return sum(os.path.getsize(p) for p in paths)


def iter_source(path: str | Path, max_bytes: int | None = None, split: str | None = None
                ) -> Iterator[tuple[int, int, str | None, str | None]]:
    """Stream one input's records as ``(number, nbytes, text, error)``, like ``iter_jsonl_lines_sized``.

    For a row source ``number`` is the 0-based row index, ``text`` the record's JSON (UTF-8, null fields
    dropped as described above), ``nbytes`` its size in bytes; a record over ``max_bytes`` bytes, or one that
    does not convert to JSON, comes with ``text=None`` and an ``error``. For an Energon dataset ``number`` is the
    sample's place in the dataset (:func:`position` gives its shard and key), ``text`` its ``json`` member as is
    (the record parser refuses one with media: :func:`packsft.packing.energon.check_text_only`).

    ``path`` and ``split`` passed :func:`check_source`.

    Raises:
        SourceError: the file or folder cannot be read (corrupt, not Parquet/Arrow), naming it.
    """
    p = Path(path)
    if not is_row_source(p):
        yield from iter_jsonl_lines_sized(p, max_bytes)
        return
    if is_energon(p):
        yield from _iter_energon(p, max_bytes, split)
        return
    index = 0
    try:
        for batch in _record_batches(p, split):
            for start in range(0, batch.num_rows, _ROWS_PER_BATCH):
                for record in batch.slice(start, _ROWS_PER_BATCH).to_pylist():
                    yield (index, *_record_json(record, max_bytes))
                    index += 1
    except Exception as err:  # noqa: BLE001 - pyarrow/datasets raise many types for a corrupt file
        at = f"row {index}" if index else "before its first row"  # a whole-file failure has no row to name
        raise SourceError(f"{path}: {at}: cannot be read as {_kind(p)} ({type(err).__name__}: {err})") from err


def _iter_energon(path: Path, max_bytes: int | None, split: str | None
                  ) -> Iterator[tuple[int, int, str | None, str | None]]:
    """:func:`iter_source` of an Energon dataset: ``number`` is :func:`packsft.packing.energon.iter_samples`'s."""
    at = "before its first sample"
    try:
        for number, shard, key, payload in energon.iter_samples(path, "train" if split is None else split):
            at = f"after {shard}: sample {key}"
            yield (number, *energon.payload_text(payload, max_bytes))
    except Exception as err:  # noqa: BLE001 - energon and tarfile raise many types for a corrupt shard
        raise SourceError(f"{path}: {at}: cannot be read as {_kind(path)} ({type(err).__name__}: {err}); if a "
                          f"shard changed since energon prepare, run energon prepare {path} again") from err


def _kind(path: Path) -> str:
    if is_energon(path):
        return "an Energon dataset"
    return "a datasets save_to_disk folder" if path.is_dir() else f"a {path.suffix.lower()[1:].capitalize()} file"


def _record_batches(path: Path, split: str | None):
    """Arrow record batches (``pyarrow.RecordBatch`` or ``Table``) of a row source, one at a time."""
    pa = _import("pyarrow")
    if path.is_dir():
        datasets = _import("datasets")
        ds = datasets.load_from_disk(str(_split_folder(path, split)))
        yield from ds.with_format("arrow").iter(batch_size=1024)
    elif path.suffix.lower() == ".parquet":
        pq = _import("pyarrow.parquet")
        # pre_buffer (pyarrow's default) would cache every row group read so far: memory grows with the file
        with pq.ParquetFile(path, pre_buffer=False) as f:
            yield from f.iter_batches(batch_size=1024)
    else:
        with pa.memory_map(str(path), "r") as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    yield reader.get_batch(i)
                return
            yield from reader


def _json_value(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise TypeError("holds binary data that is not UTF-8 text") from None
    raise TypeError(f"holds a {type(value).__name__}, which has no JSON form")


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        keep = "role" in value  # a message: its null content stays
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None or (keep and k == "content")}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _record_json(record: dict[str, Any], max_bytes: int | None) -> tuple[int, str | None, str | None]:
    """``(nbytes, text, error)`` of one row's record."""
    try:
        text = json.dumps(_drop_nulls(record), ensure_ascii=False, default=_json_value)
    except (TypeError, ValueError) as err:
        return 0, None, f"the row {err}; not tokenized"
    nbytes = len(text.encode("utf-8"))
    if max_bytes is not None and nbytes > max_bytes:
        return nbytes, None, (f"row's JSON has {nbytes} bytes, more than --max-conversation-bytes {max_bytes}; "
                              "not tokenized")
    return nbytes, text, None


def source_identity(path: str | Path, split: str | None = None, shard_index_only: bool = False) -> dict[str, Any]:
    """What identifies a row source's content (one that passed :func:`check_source`), for the sidecar.

    Returns:
        ``{"kind": "dataset" | "parquet" | "arrow", "num_rows": int, "files": [{"name", "size", "blake2b"}],
        "split"?, "fingerprint"?}``: a folder lists its ``state.json``, ``dataset_info.json`` and data files
        (names relative to ``path``) and the ``_fingerprint`` of its ``state.json``; sizes in bytes, BLAKE2b-160.
        An Energon dataset: ``{"kind": "energon", "split", "num_samples", "files"}``, its ``.nv-meta/.info.json``,
        split file, ``dataset.yaml`` and the split's shards. With ``shard_index_only`` (the trainer, at every
        start) a shard is not read: its entry is ``{"name", "size", "index_blake2b"}``, the BLAKE2b of the
        ``.tar.idx`` that ``energon prepare`` wrote (every sample's offset), so a sample added, removed or
        resized changes it.
    """
    p = Path(path)
    out: dict[str, Any] = {}
    if is_energon(p):
        name = "train" if split is None else split
        files, count = energon.identity_files(p, name)
        out.update(kind="energon", split=name, num_samples=count)
    elif p.is_dir():
        folder = _split_folder(p, split)
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = ["state.json", "dataset_info.json"] + [f["filename"] for f in state.get("_data_files", [])]
        files = [folder / n for n in names if (folder / n).is_file()]
        if folder != p:
            files.insert(0, p / "dataset_dict.json")
        out.update(kind="dataset", **({"split": split} if folder != p else {}),
                   fingerprint=state.get("_fingerprint"))
        datasets = _import("datasets")
        out["num_rows"] = datasets.load_from_disk(str(folder)).num_rows
    else:
        files = [p]
        out["kind"] = p.suffix.lower()[1:]
        pa = _import("pyarrow")
        if out["kind"] == "parquet":
            out["num_rows"] = _import("pyarrow.parquet").ParquetFile(p).metadata.num_rows
        else:
            with pa.memory_map(str(p), "r") as source:
                try:
                    out["num_rows"] = sum(b.num_rows for b in pa.ipc.open_stream(source))
                except pa.ArrowInvalid:
                    source.seek(0)
                    out["num_rows"] = pa.ipc.open_file(source).count_rows()
    def digest(f: Path) -> dict[str, str]:
        if shard_index_only and f.suffix == ".tar":
            return {"index_blake2b": file_blake2b(f.with_name(f.name + ".idx"))}
        return {"blake2b": file_blake2b(f)}

    out["files"] = [{"name": str(f.relative_to(p)) if f != p else f.name, "size": f.stat().st_size, **digest(f)}
                    for f in files]
    return out

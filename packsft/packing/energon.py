"""Energon datasets as pack inputs: folders prepared by ``energon prepare`` (WebDataset ``.tar`` shards plus
``.nv-meta/`` with ``.info.json``, ``split.yaml`` and ``index.sqlite``), read sample by sample with
megatron-energon's own reader (``packsft[energon]`` extra, imported only here and only when such an input is given).

A split is read the way Energon reads it without shuffling: its shards in ``split.yaml`` order, each shard's
samples in tar order, the samples ``split.yaml`` excludes left out. A sample's payload is its ``json`` member
(``000017.json``), the record ``{"messages": [...], "media": [...], "tools": ...}``; its other members are not
read. The packer packs text: a sample whose payload lists media or holds a non-text content part is refused with
a reason (:func:`check_text_only`).

A sample is numbered by its place in the whole dataset (the shards in ``.info.json`` order, then its index in its
shard), whatever the split, so that its shard and key can be found again from that number (:func:`locate`).
"""

from __future__ import annotations

import functools
import struct
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path

from packsft.jsonl import ConversationError

META = ".nv-meta"
TEXT_ONLY = ("read as text only here (image-text samples train a LLaVA model with data.energon.model_family: "
             "llava, docs/multimodal.md)")
PAYLOAD = "json"
"""The member extension that holds a sample's JSON record."""


def is_energon(path: str | Path) -> bool:
    """True for a folder prepared by ``energon prepare`` (it has ``.nv-meta/``)."""
    return (Path(path) / META).is_dir()


def dataset_above(path: str | Path) -> Path | None:
    """The Energon dataset folder that ``path`` (a shard, a shard folder, ``.nv-meta/``) lies inside, or None."""
    return next((folder for folder in Path(path).absolute().parents if is_energon(folder)), None)


def _epath(path: str | Path):
    from megatron.energon.epathlib import EPath

    return EPath(str(Path(path).resolve()))


def split_names(path: str | Path) -> dict[str, int]:
    """``{split: number of shards}`` of the dataset's ``split.yaml`` (or ``split.json``), in file order.

    Raises:
        OSError, ValueError: the split file is missing (named as ``split.yaml``) or not a split config.
    """
    from megatron.energon.eyaml import load_yaml_json

    meta = _epath(path) / META
    name = "split.json" if (meta / "split.json").is_file() else "split.yaml"
    parts = load_yaml_json(meta / name)["split_parts"]
    return {str(k): len(v or []) for k, v in parts.items()}


def split_meta(path: str | Path, split: str):
    """Energon's ``WebdatasetMeta`` of ``split``: its ``shards`` (``name``, ``path``, ``count``) and
    ``sample_excludes`` (``shard/key`` names).

    Raises:
        megatron.energon.flavors.webdataset.empty_dataset_error.EmptyDatasetError: the split has no shards.
    """
    from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

    return WebdatasetMeta.from_config(_epath(path), split_part=split)


def _shard_offsets(path: str | Path) -> tuple[list[str], list[int]]:
    """The dataset's shard names in ``.info.json`` order and the number of samples before each (plus the total)."""
    from megatron.energon.flavors.webdataset.metadata import get_dataset_info

    counts = get_dataset_info(_epath(path))["shard_counts"]
    offsets = [0]
    for n in counts.values():
        offsets.append(offsets[-1] + n)
    return list(counts), offsets


def iter_samples(path: str | Path, split: str) -> Iterator[tuple[int, str, str, bytes | None]]:
    """The samples of ``split`` in Energon's order: ``(number, shard, key, payload)``.

    ``number`` is the sample's place in the whole dataset (:func:`locate` maps it back), ``payload`` its ``json``
    member's bytes, or None when it has none.
    """
    for number, shard, key, members in iter_sample_members(path, split, PAYLOAD):
        yield number, shard, key, members.get(PAYLOAD)


def iter_sample_members(path: str | Path, split: str, only: str | None = None
                        ) -> Iterator[tuple[int, str, str, dict[str, bytes]]]:
    """:func:`iter_samples` with each sample's members, ``{extension: bytes}`` (``json``, ``first.jpg``): all of
    them, or only the ``only`` one (the others are not read)."""
    from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader

    meta = split_meta(path, split)
    names, offsets = _shard_offsets(path)
    first = dict(zip(names, offsets))
    excluded = meta.sample_excludes
    reader = ShardInfosITarReader(_epath(path), meta.shards, part_filter=None if only is None else
                                  lambda ext: ext == only,
                                  sample_filter=lambda name: name not in excluded, itar_cache_size=1)
    try:
        for i, shard in enumerate(meta.shards):
            start = reader.shard_count_cumsum[i]
            for j in range(shard.count):
                sample = reader[start + j]
                if sample is not None:  # None: excluded by split.yaml
                    yield first[shard.name] + j, shard.name, sample["__key__"], {
                        k: v for k, v in sample.items() if not k.startswith("__")}
    finally:
        reader.close()


@functools.lru_cache(maxsize=8)
def _index(path: str, stamp: int):
    """The shard names, offsets and Energon's sqlite index of a dataset (``stamp``: its ``.info.json``'s mtime)."""
    from megatron.energon.flavors.webdataset.indexing import SqliteIndexReader

    names, offsets = _shard_offsets(path)
    sqlite = _epath(path) / META / "index.sqlite"
    return names, offsets, SqliteIndexReader(sqlite) if sqlite.is_file() else None


def locate(path: str | Path, number: int) -> tuple[str, str]:
    """``(shard, key)`` of the sample numbered ``number`` by :func:`iter_samples`; the key is ``#i`` (its index in
    the shard) for a dataset prepared without ``index.sqlite``."""
    info = Path(path) / META / ".info.json"
    names, offsets, index = _index(str(path), info.stat().st_mtime_ns if info.is_file() else 0)
    shard = bisect_right(offsets, number) - 1
    within = number - offsets[shard]
    row = index.db.select_one("SELECT sample_key FROM samples WHERE tar_file_id = ? AND sample_index = ?",
                              (shard, within)) if index is not None else None
    return names[shard], row[0] if row else f"#{within}"


def changed_shard(path: str | Path, split: str) -> str | None:
    """What differs in the first of ``split``'s shards that is not the file ``energon prepare`` indexed, or None.

    Energon reads a shard by the sample offsets in its ``.tar.idx``, so samples appended to a shard after
    ``energon prepare`` would never be read, and a shard replaced by one of other samples reads wrongly. A shard
    is taken as indexed when the index is there, the file is as long as the index's end, and only zero bytes (the
    tar's end blocks) follow that end.
    """
    for shard in split_meta(path, split).shards:
        tar = Path(path) / shard.name
        idx = tar.with_name(tar.name + ".idx")
        if not idx.is_file():
            return f"{shard.name}: has no index ({idx.name})"
        with open(idx, "rb") as f:
            f.seek(-8, 2)
            (end,) = struct.unpack("Q", f.read(8))
        with open(tar, "rb") as f:
            f.seek(end)
            tail = f.read(1024)
        size = tar.stat().st_size
        if size < end or tail.strip(b"\0"):  # only the tar's end blocks (zeros) may follow the last sample
            return (f"{shard.name}: its {size} bytes do not end where its {shard.count} indexed samples end (byte "
                    f"{end}): samples added, or the shard replaced, since energon prepare")
    return None


def payload_text(payload: bytes | None, max_bytes: int | None) -> tuple[int, str | None, str | None]:
    """``(nbytes, text, error)`` of a sample's ``json`` member (``payload`` None: it has none): ``text`` None and
    ``error`` the reason when it is missing, over ``max_bytes`` or not UTF-8."""
    if payload is None:
        return 0, None, "the sample has no .json member (its JSON record); not tokenized"
    nbytes = len(payload)
    if max_bytes is not None and nbytes > max_bytes:
        return nbytes, None, (f"sample's .json member has {nbytes} bytes, more than --max-conversation-bytes "
                              f"{max_bytes}; not tokenized")
    try:
        return nbytes, payload.decode("utf-8"), None
    except UnicodeDecodeError:
        return nbytes, None, "the sample's .json member is not UTF-8 text; not tokenized"


def check_text_only(record: object, path: str, line: int) -> None:
    """Refuse a sample's decoded record that cannot be packed as text: it lists media, or a message holds a
    non-text content part. A record that is not an object with messages is left to the record parser.

    Raises:
        packsft.jsonl.ConversationError: at ``path``, ``line``, naming the field (``media``,
            ``messages[i].content[j]``).
    """
    problem = _text_only_problem(record)
    if problem:
        raise ConversationError(path, line, *problem)


def _text_only_problem(record: object) -> tuple[str, str] | None:
    if not isinstance(record, dict):
        return None
    media = record.get("media")
    if media:
        count = f"{len(media)} item(s)" if isinstance(media, list) else repr(media)
        return "media", f"the sample has media ({count}); {TEXT_ONLY}"
    messages = record.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", None):
                return f"messages[{i}].content[{j}]", f"a non-text part ({kind!r}); {TEXT_ONLY}"
    return None


def identity_files(path: str | Path, split: str) -> tuple[list[Path], int]:
    """The files that identify ``split`` of a dataset (``.info.json``, the split file, ``dataset.yaml``, the
    split's shards in order) and its number of samples (the excluded ones left out)."""
    p, meta_dir = Path(path), Path(path) / META
    meta = split_meta(path, split)
    files = [meta_dir / n for n in (".info.json", ".info.yaml", "split.yaml", "split.json", "dataset.yaml")
             if (meta_dir / n).is_file()]
    files += [p / shard.name for shard in meta.shards]
    shards = {shard.name for shard in meta.shards}
    excluded = sum(1 for name in meta.sample_excludes if name.rsplit("/", 1)[0] in shards)
    return files, sum(shard.count for shard in meta.shards) - excluded


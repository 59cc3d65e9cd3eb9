"""The packed file's sidecar ``X.jsonl.packed.meta.json``: writing, reading, and refusing a mismatched file.

A packed row only makes sense with the tokenizer, prompt format, pad, ``max_seq_len`` and
``context_parallel_size`` it was packed for: another tokenizer gives other lengths, another CP
size other padding. The packer records them with :func:`write_sidecar`; the loader compares them with its own
configuration through :func:`check_sidecar` and refuses the file on any difference.

Sidecar fields (JSON object, ``format_version`` 2)::

    {"format_version": 2,
     "tokenizer_fingerprint": str,        # packsft.tokenizer.tokenizer_fingerprint
     "prompt_format": {"name": str, "pad_token": str, "pad_token_id": int,
                       "chat_template_sha256": str | null, "train_on": "all" | "last",
                       "chat_template_kwargs": {...}, "append_eos": bool},   # PromptFormat.spec()
     "special_tokens": {"bos_token": str | null, "bos_token_id": int | null,
                        "eos_token": str | null, "eos_token_id": int | null},   # optional (see special_tokens)
     "max_seq_len": int, "context_parallel_size": int,
     "algorithm": str, "seed": int, "counts": {...}, ...,
     "rows_file": {"size": int, "blake2b": str},   # the rows file's bytes (BLAKE2b-160, 40 hex)
     "token_cache": {"format_version": 1, "rows": int, "conversations": int, "stored_tokens": int,
                     "tokens": {"file", "size", "blake2b", "ends_blake2b"}, "index": {...}}}  # optional

Only the tokenizer, prompt format, ``max_seq_len`` and CP size are checked (:data:`CHECKED_FIELDS`), and the
tokenizer's BOS/EOS when recorded (``special_tokens``, :data:`OPTIONAL_CHECKED_FIELDS`; recorded where the
format's ids depend on them); the rest describe the packing run. A version 1 sidecar (before ``train_on``,
``chat_template_kwargs`` and ``append_eos``) is read with their defaults, ``all``, ``{}`` and ``false``: what
version 1 packed.

``rows_file`` ties the sidecar to the rows it was written with (the packer publishes its outputs as one unit,
through a journal that :func:`read_sidecar` finishes after a kill; the sidecar last):
:func:`check_rows_file` compares the size always and the hash for files up to :data:`HASH_AUTO_LIMIT` bytes
(or always / never on request). Sidecars written before this field existed carry none and are not checked.

A refusal ends with the packer command that makes a file the loader accepts (:mod:`packsft.data.repack`).

``token_cache`` (optional, :mod:`packsft.token_cache`) does the same for the two token cache files beside the rows:
:func:`check_token_cache` compares their sizes and the BLAKE2b of their first and last MiB always, and their whole
hash under the rows file's policy. A sidecar without it (older packsft, or ``--no-token-cache``) reads as before:
the loader re-tokenizes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from packsft.io import atomic_open, file_blake2b, finish_interrupted_publish, read_json_object
from packsft.prompt_formats import PromptFormat, Tokenization
from packsft.token_cache import cache_paths, ends_blake2b

SIDECAR_SUFFIX = ".meta.json"
REPORT_SUFFIX = ".report.json"
"""The packer's report beside the rows by default (``X.jsonl.packed.report.json``); its ``settings`` are the run's."""
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
CHECKED_FIELDS = (
    "tokenizer_fingerprint",
    "prompt_format.name",
    "prompt_format.pad_token",
    "prompt_format.pad_token_id",
    "prompt_format.chat_template_sha256",
    "prompt_format.train_on",
    "prompt_format.chat_template_kwargs",
    "prompt_format.append_eos",
    "max_seq_len",
    "context_parallel_size",
)
OPTIONAL_CHECKED_FIELDS = ("special_tokens",)
"""Checked like :data:`CHECKED_FIELDS` when the sidecar records them (packsft before them did not): the tokenizer's
BOS and EOS (:func:`special_tokens`), which ``tokenizer_config.json`` sets beside an unchanged ``tokenizer.json`` (so
the fingerprint misses them) and which change the ids (``--append-eos``, a template's ``eos_token``/``bos_token``)."""
V1_DEFAULTS = {"train_on": "all", "chat_template_kwargs": {}, "append_eos": False}
"""``prompt_format`` fields a version 1 sidecar lacks, with what version 1 packed."""
PACK_TOOL = "tools/pack_megatron_sft_jsonl.py"
HASH_AUTO_LIMIT = 256 << 20
"""Rows files up to this size (bytes) have their hash checked by default (about 0.3 s at 1 GB/s)."""
REPACK_INTRO = "Re-pack it into a new file (then point the config at it)"
"""What precedes the re-pack command in the loader's refusals."""
class SidecarError(ValueError):
    """A sidecar that is unreadable, of an unknown version, or that contradicts the loader's configuration."""


def sidecar_path(packed_path: str | Path) -> Path:
    """Sidecar of a packed file: ``X.jsonl.packed`` -> ``X.jsonl.packed.meta.json``; a sidecar path is kept."""
    p = Path(packed_path)
    return p if p.name.endswith(SIDECAR_SUFFIX) else p.with_name(p.name + SIDECAR_SUFFIX)


ROW_INDEX_SUFFIX = ".idx"


def row_index_path(path: str | Path, index_path: str | Path | None = None) -> Path:
    """Where the loader caches the row index of packed file ``path``: ``index_path`` when given, else
    ``<path>.idx`` (the packer refuses an input of that name: the loader would overwrite it)."""
    return Path(index_path) if index_path is not None else Path(str(path) + ROW_INDEX_SUFFIX)


def rows_path(path: str | Path) -> Path:
    """The packed file of a sidecar path (``X.jsonl.packed.meta.json`` -> ``X.jsonl.packed``); others are kept."""
    p = Path(path)
    return p.with_name(p.name[: -len(SIDECAR_SUFFIX)]) if p.name.endswith(SIDECAR_SUFFIX) else p


def refuse_sidecar_as_rows(path: str | Path) -> None:
    """Raise ``ValueError`` when ``path``, given as a packed rows file, is a sidecar (``X.jsonl.packed.meta.json``),
    naming its rows file."""
    if Path(path).name.endswith(SIDECAR_SUFFIX):
        raise ValueError(f"{path} is a sidecar: give its packed rows file, {rows_path(path)}")


def efficiency(real_tokens: int, padding_tokens: int) -> float:
    """Packing efficiency, real tokens / all row tokens; 0.0 for no tokens."""
    return real_tokens / (real_tokens + padding_tokens) if real_tokens + padding_tokens else 0.0


def packing_efficiency(*metas: dict[str, Any] | None) -> float | None:
    """The efficiency of packed files together (a mixture's sources) from their sidecars' ``counts``: ``None``
    without a sidecar, or when one's counts are not two non-negative integers (they are informational: nothing
    checks them against the rows)."""
    real = padding = 0
    for meta in metas:
        counts = (meta or {}).get("counts")
        if not isinstance(counts, dict):
            return None
        pair = counts.get("real_tokens"), counts.get("padding_tokens")
        if not all(type(n) is int and n >= 0 for n in pair):
            return None
        real, padding = real + pair[0], padding + pair[1]
    return efficiency(real, padding)


def write_sidecar(path: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``meta`` (:func:`sidecar_text`) as the sidecar of ``path`` (the packed file or the sidecar path)
    atomically (temporary file in the same folder + ``os.replace``); return the sidecar path.

    Raises:
        TypeError: ``meta`` is not JSON-serialisable (nothing is written).
    """
    text = sidecar_text(meta)
    with atomic_open(target := sidecar_path(path)) as f:
        f.write(text)
    return target


def sidecar_text(meta: dict[str, Any]) -> str:
    """The sidecar file's text for ``meta`` (sorted, indented JSON; ``format_version`` set when absent)."""
    return json.dumps({"format_version": FORMAT_VERSION, **meta}, indent=2, sort_keys=True) + "\n"


def read_sidecar(path: str | Path) -> dict[str, Any] | None:
    """Read the sidecar of a packed file.

    Args:
        path: the packed file or its sidecar path.

    Returns:
        The sidecar dict (a version 1 one with :data:`V1_DEFAULTS` filled in), or ``None`` without one.

    A packer killed while publishing leaves a journal: this first finishes its renames
    (:func:`packsft.io.finish_interrupted_publish`), so the sidecar read belongs to the rows beside it.

    Raises:
        SidecarError: not valid JSON, not an object, an unknown ``format_version``, a checked field missing, or
            ``max_seq_len`` / ``context_parallel_size`` not an integer >= 1.
        OSError: an interrupted publish that this process cannot finish (read-only folder).
    """
    target = sidecar_path(path)
    finish_interrupted_publish(rows_path(target))
    if not target.is_file():
        return None
    meta = read_json_object(target, SidecarError)
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise SidecarError(f"{target}: format_version {meta.get('format_version')!r} is not supported "
                           f"(this packsft reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-pack the "
                           f"file with {PACK_TOOL}")
    if meta["format_version"] == 1 and isinstance(meta.get("prompt_format"), dict):
        meta["prompt_format"] = {**V1_DEFAULTS, **meta["prompt_format"]}
    missing = [f for f in CHECKED_FIELDS if _get(meta, f) is _MISSING]
    wrong = [f"missing field(s) {missing}"] if missing else [
        f"{f} is {json.dumps(meta[f])}, not an integer >= 1" for f in ("max_seq_len", "context_parallel_size")
        if isinstance(meta[f], bool) or not isinstance(meta[f], int) or meta[f] < 1]
    if wrong:
        raise SidecarError(f"{target}: {'; '.join(wrong)}; re-pack the file with {PACK_TOOL}")
    return meta


_MISSING = object()


def _get(meta: dict[str, Any], dotted: str) -> Any:
    value: Any = meta
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def special_tokens(tokenizer: Any, fmt: PromptFormat) -> dict[str, Any] | None:
    """The sidecar's ``special_tokens``: the tokenizer's ``bos_token``, ``bos_token_id``, ``eos_token``,
    ``eos_token_id`` (``None`` where it has none), when ``fmt``'s ids depend on them (``append_eos``, or a chat
    template that renders ``bos_token`` / ``eos_token``); else ``None``: not recorded, not checked."""
    if not (fmt.append_eos or any(t in (fmt.chat_template or "") for t in ("bos_token", "eos_token"))):
        return None
    return {"bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id,
            "eos_token": tokenizer.eos_token, "eos_token_id": tokenizer.eos_token_id}


def tokenization_fields(tokenization: Tokenization, fingerprint: str | None = None) -> dict[str, Any]:
    """The sidecar's record of the packer's resolved tokenization: ``tokenizer`` (its path),
    ``tokenizer_fingerprint`` (``fingerprint`` when a worker already took it), ``prompt_format``
    (:meth:`PromptFormat.spec`) and, where the ids depend on them, ``special_tokens``."""
    specials = special_tokens(tokenization.tokenizer, tokenization.fmt)
    return {"tokenizer_fingerprint": fingerprint or tokenization.fingerprint, "prompt_format": tokenization.fmt.spec(),
            "tokenizer": str(tokenization.spec.tokenizer), **({"special_tokens": specials} if specials else {})}


def loader_expectation(fingerprint: str, fmt: PromptFormat, max_seq_len: int,
                       context_parallel_size: int, specials: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checked sidecar fields as the loader's configuration sets them (same layout as the sidecar);
    ``specials``: the loader tokenizer's :func:`special_tokens` (checked when the sidecar records them)."""
    expected = {"tokenizer_fingerprint": fingerprint, "prompt_format": fmt.spec(), "max_seq_len": max_seq_len,
                "context_parallel_size": context_parallel_size}
    if specials is not None:
        expected["special_tokens"] = specials
    return expected


def check_sidecar(meta: dict[str, Any], expected: dict[str, Any], packed_path: str | Path,
                  hint: str | Callable[[], str]) -> None:
    """Refuse a packed file whose sidecar contradicts the loader's configuration.

    Args:
        meta: the sidecar (:func:`read_sidecar`).
        expected: the loader's values (:func:`loader_expectation`).
        packed_path: the packed file, for the message.
        hint: the re-pack command (:func:`packsft.data.repack.repack_hint`), or a function returning it, called
            only on a refusal (the hint may read the packing report).

    Raises:
        SidecarError: naming every differing field with the packed and the loader's value, e.g.
            ``context_parallel_size: packed for 1, loader has 2``, followed by the re-pack command.
    """
    diffs = []
    optional = [f for f in OPTIONAL_CHECKED_FIELDS
                if _get(meta, f) is not _MISSING and _get(expected, f) is not _MISSING]
    for field in (*CHECKED_FIELDS, *optional):
        packed, wanted = _get(meta, field), _get(expected, field)
        if packed != wanted:
            diffs.append(f"  {field}: packed for {packed!r}, loader has {wanted!r}")
    if diffs:
        raise SidecarError(f"{packed_path} was packed for another configuration "
                           f"({sidecar_path(packed_path).name} disagrees with the loader):\n" + "\n".join(diffs)
                           + f"\n{REPACK_INTRO} for this configuration:\n  {hint() if callable(hint) else hint}")


def rows_file_fields(size: int, blake2b: str) -> dict[str, Any]:
    """The sidecar's ``rows_file`` entry for a rows file of ``size`` bytes with BLAKE2b-160 hex ``blake2b``."""
    return {"rows_file": {"size": int(size), "blake2b": str(blake2b)}}


def check_rows_file(meta: dict[str, Any], packed_path: str | Path, verify_hash: bool | None = None) -> bool:
    """Refuse a rows file that is not the one its sidecar was written with.

    Args:
        meta: the sidecar (:func:`read_sidecar`).
        packed_path: the rows file.
        verify_hash: ``True``: always hash the file; ``False``: size only; ``None``: hash when the file is at
            most :data:`HASH_AUTO_LIMIT` bytes.

    Returns:
        Whether the hash was checked (``False`` also for a sidecar without ``rows_file``, which is not checked).

    Raises:
        SidecarError: the size or hash differs, naming both files and both values (a re-pack killed between
            publishing the rows and the sidecar, or one of the two copied or edited alone).
    """
    expected = meta.get("rows_file")
    if not isinstance(expected, dict):
        return False
    advice = (f"the two files come from different packing runs (a re-pack killed before it finished, or one "
              f"file copied or edited alone); re-pack with {PACK_TOOL} (its re-run replaces both)")
    return _match_recorded(Path(packed_path), expected, _ROWS_FILE_FIELDS, packed_path, verify_hash, advice)


_MEASURES: dict[str, Callable[[Path], Any]] = {"size": lambda p: p.stat().st_size, "ends_blake2b": ends_blake2b,
                                               "blake2b": file_blake2b}
"""How each recorded fingerprint field of a file is measured: bytes, BLAKE2b-160 of its ends, of all of it."""
_ROWS_FILE_FIELDS = (("size", "the rows file has {} bytes"), ("blake2b", "the rows file's BLAKE2b is {}"))
_CACHE_FILE_FIELDS = (("size", "the file has {} bytes"),
                      ("ends_blake2b", "the BLAKE2b of its first and last MiB is {}"), ("blake2b", "its BLAKE2b is {}"))
"""``(field, what the file's measured value is)`` in the order they are compared (cheapest first)."""


def _match_recorded(path: Path, recorded: dict[str, Any], fields: tuple[tuple[str, str], ...],
                    packed_path: str | Path, verify_hash: bool | None, advice: str) -> bool:
    """Compare file ``path`` with the fingerprint its sidecar records (``recorded``), field by field.

    ``blake2b`` (the whole file's hash) is compared only under ``verify_hash``'s policy (:func:`check_rows_file`).

    Returns:
        Whether the whole hash was compared.

    Raises:
        SidecarError: the first field that differs, naming ``path``, the sidecar of ``packed_path``, both values
            and ``advice``.
    """
    hashed = not (verify_hash is False or (verify_hash is None and path.stat().st_size > HASH_AUTO_LIMIT))
    for key, found in fields:
        if key == "blake2b" and not hashed:
            continue
        value = _MEASURES[key](path)
        if value != recorded.get(key):
            raise SidecarError(f"{path} does not match its sidecar {sidecar_path(packed_path)}: {found.format(value)}, "
                               f"the sidecar records {recorded.get(key)}; {advice}")
    return hashed


CACHE_SETTINGS = ("tokenizer_fingerprint", "special_tokens", "prompt_format")
"""The sidecar fields that decide a token cache's ids and targets (``max_seq_len`` is in the cache's index)."""


def cache_settings_blake2b(meta: dict[str, Any]) -> str:
    """BLAKE2b-160 (40 hex) of the sidecar's :data:`CACHE_SETTINGS` as canonical JSON: recorded in its
    ``token_cache`` entry by the packer, so that a sidecar edited since (another ``train_on``, tokenizer) does
    not vouch for a cache written under other settings."""
    text = json.dumps({k: meta.get(k) for k in CACHE_SETTINGS}, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=20).hexdigest()


def cache_settings_changed(meta: dict[str, Any]) -> bool:
    """Whether the sidecar's ``token_cache`` entry records a ``settings_blake2b`` that its :data:`CACHE_SETTINGS` no
    longer give (the sidecar edited after packing; an entry without it, from an earlier packsft, is trusted)."""
    entry = meta.get("token_cache")
    return isinstance(entry, dict) and entry.get("settings_blake2b") not in (None, cache_settings_blake2b(meta))


def check_token_cache(meta: dict[str, Any], packed_path: str | Path, verify_hash: bool | None = None) -> bool:
    """Refuse token cache files (:mod:`packsft.token_cache`) that are not the ones the sidecar records.

    Call it when ``meta`` has a ``token_cache`` entry and both files exist beside ``packed_path``.

    Args:
        meta: the sidecar (:func:`read_sidecar`).
        packed_path: the rows file; the cache files are ``<packed_path>.tokens.npy`` and ``.tokens-index.npy``.
        verify_hash: as :func:`check_rows_file`, per file: ``True`` always hash the whole file, ``False``
            never, ``None`` when it is at most :data:`HASH_AUTO_LIMIT` bytes. Size and the hash of the first
            and last MiB (``ends_blake2b``) are always compared (a ``stat`` and 2 MiB read per file).

    Returns:
        Whether both files' whole hashes were checked.

    Raises:
        SidecarError: a size or hash differs, naming the cache file, the sidecar and both values (an entry the
            sidecar lacks records ``None``).
    """
    entry = meta["token_cache"]
    advice = (f"the token cache and the sidecar come from different packing runs (a re-pack killed before it "
              f"finished, or a file copied or edited alone); delete the cache files to re-tokenize, or re-pack "
              f"with {PACK_TOOL}")
    hashed = True
    for key, path in zip(("tokens", "index"), cache_paths(packed_path)):
        recorded = entry.get(key) if isinstance(entry, dict) else None
        hashed &= _match_recorded(path, recorded if isinstance(recorded, dict) else {}, _CACHE_FILE_FIELDS,
                                  packed_path, verify_hash, advice)
    return hashed

"""Model-only Megatron checkpoints: written by ``tools/convert_checkpoint.py import``, read by ``init_from``.

Layout of ``ckpt_dir``::

    .metadata, __*_*.distcp     # torch_dist shards of {"model": model.sharded_state_dict()} (dist_checkpointing)
    common.pt, metadata.json    # dist_checkpointing common state
    model_config.json           # ModelConfig fields (packsft.model.config.read_model_config)
    vision_config.json          # a LLaVA model only: VisionConfig fields + image_token_id (its vision: section)
    hf_config.json              # optional: the source HF config (packsft.model.hf_files.read_hf_config)
    weights_fingerprint.json    # BLAKE2b of each dist_checkpointing file and of them all (weights_fingerprint)

The weights (a ``GPTModel``'s, or a ``LLaVAModel``'s: vision tower, projector and ``language_model.*``) sit under
``"model"`` with their global shapes, as in the trainer's checkpoints
(:mod:`packsft.train.checkpoint`), so :func:`load_megatron_checkpoint` reads either folder at any TP size.
Atomicity: all ranks write into ``.<name>.tmp`` beside ``ckpt_dir``; rank 0 then publishes it
(``packsft.io.replace_dir``).

Base identity (LoRA runs): a LoRA run started from such a folder stores only its adapters and records
:func:`base_identity` of the folder (absolute path + fingerprint); on resume and export :func:`check_lora_base`
refuses a base folder whose fingerprint differs, naming both. The fingerprint is computed once, when the folder is
written, and read back from ``weights_fingerprint.json`` while the files still have the recorded sizes and
modification times (a folder without that file or these records, or whose files were replaced or copied, is hashed
again: about 1 GB/s).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pickle
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from packsft.io import file_blake2b, read_json_object, replace_dir, write_json_atomic
from packsft.model.config import MODEL_CONFIG_FILE, VISION_CONFIG_FILE, ModelConfig
from packsft.model.hf_files import HF_CONFIG_FILE
from packsft.process_groups import barrier, global_rank
from packsft.train import process_guard
from packsft.train.checkpoint_files import CheckpointError

FINGERPRINT_FILE = "weights_fingerprint.json"
_NOT_WEIGHTS = (MODEL_CONFIG_FILE, VISION_CONFIG_FILE, HF_CONFIG_FILE, FINGERPRINT_FILE)


class BaseMismatchError(ValueError):
    """A LoRA checkpoint's recorded base differs from the base folder it is loaded with (or that folder is gone)."""


def _weight_files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.iterdir() if p.is_file() and p.name not in _NOT_WEIGHTS)


_UNSTABLE = (".metadata",)
"""Files left out of the fingerprint: torch's distributed checkpoint index, which besides the tensors' places holds
a random save id and the path it was written at, so two imports of one model differ there only."""


def _fingerprint(files: dict[str, dict], skip: tuple[str, ...] = _UNSTABLE) -> str:
    """BLAKE2b-128 (32 hex) of the ``name size hash`` lines of ``files`` (in their order), but ``skip``."""
    lines = "".join(f"{name} {f['bytes']} {f['blake2b']}\n" for name, f in files.items() if name not in skip)
    return hashlib.blake2b(lines.encode(), digest_size=16).hexdigest()


def weights_fingerprint(ckpt_dir: str | Path) -> dict:
    """Hash every ``dist_checkpointing`` file of a model folder (not its JSON configs).

    Returns:
        ``{"files": {name: {"bytes": int, "mtime_ns": int, "blake2b": 40 hex}}, "fingerprint": 32 hex}``; the
        fingerprint is the BLAKE2b-128 of the sorted ``name size hash`` lines of the files holding the weights
        (not torch's ``.metadata`` index: :data:`_UNSTABLE`), so it changes with any byte of any weight and is the
        same for two imports of one model (``mtime_ns`` only tells :func:`base_identity` whether the stored
        hashes still apply).
    """
    stats = {p: p.stat() for p in _weight_files(Path(ckpt_dir))}
    files = {p.name: {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "blake2b": file_blake2b(p)}
             for p, st in stats.items()}
    return {"files": files, "fingerprint": _fingerprint(files)}


def _identity(ckpt_dir: Path) -> tuple[str, str]:
    """``(fingerprint, legacy fingerprint)`` of a model folder: the legacy one (packsft before 2026-12-05, and the
    identity its LoRA checkpoints recorded) also hashed ``.metadata``."""
    files = None
    try:
        stored = json.loads((ckpt_dir / FINGERPRINT_FILE).read_text())
        stats = {p.name: (st.st_size, st.st_mtime_ns) for p in _weight_files(ckpt_dir) for st in [p.stat()]}
        if {n: (f["bytes"], f["mtime_ns"]) for n, f in stored["files"].items()} == stats and \
                all(isinstance(f["blake2b"], str) for f in stored["files"].values()):
            files = stored["files"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = None
    if files is None:
        files = weights_fingerprint(ckpt_dir)["files"]
    return _fingerprint(files), _fingerprint(files, skip=())


def base_identity(ckpt_dir: str | Path) -> dict[str, str]:
    """``{"path": absolute folder, "fingerprint": 32 hex}`` of a model folder (an imported base).

    Uses the file hashes of ``weights_fingerprint.json`` when its files are exactly the folder's, with the same
    sizes and modification times (other weights of the same shapes have the same sizes); otherwise hashes the
    files (:func:`weights_fingerprint`). ``ckpt_dir`` is ``checkpoint.init_from``, whose ``model_config.json``
    ``load_config`` has read.
    """
    ckpt_dir = Path(ckpt_dir).resolve()
    return {"path": str(ckpt_dir), "fingerprint": _identity(ckpt_dir)[0]}


def check_lora_base(recorded: dict, base_dir: str | Path | None, checkpoint: str | Path) -> Path:
    """The base folder to load under a LoRA ``checkpoint`` whose recorded base identity is ``recorded``.

    ``base_dir``: the folder given now (``checkpoint.init_from``, ``--lora-base``), or None for the recorded path.

    Raises:
        BaseMismatchError: the folder is missing or not an imported checkpoint, or its fingerprint differs from the
            recorded one (both named).
    """
    base_dir = Path(base_dir if base_dir is not None else recorded["path"])
    if not base_dir.is_dir():
        raise BaseMismatchError(
            f"checkpoint {checkpoint} holds LoRA adapters of the base {recorded['path']} (fingerprint "
            f"{recorded['fingerprint']}), but {base_dir} does not exist; point checkpoint.init_from (export: "
            "--lora-base) at that base folder")
    if not (base_dir / MODEL_CONFIG_FILE).is_file():   # e.g. the HF folder the base was imported from
        raise BaseMismatchError(
            f"checkpoint {checkpoint} holds LoRA adapters of the base {recorded['path']}, but {base_dir} is not an "
            f"imported checkpoint (no {MODEL_CONFIG_FILE}); point checkpoint.init_from (export: --lora-base) at "
            "the folder `tools/convert_checkpoint.py import` wrote")
    fingerprints = _identity(base_dir.resolve())  # a checkpoint of an earlier packsft recorded the legacy one
    current = {"path": str(base_dir.resolve()), "fingerprint": fingerprints[0]}
    if recorded["fingerprint"] not in fingerprints:
        raise BaseMismatchError(
            f"checkpoint {checkpoint} holds LoRA adapters of the base {recorded['path']} (fingerprint "
            f"{recorded['fingerprint']}), but the base given, {current['path']}, has fingerprint "
            f"{current['fingerprint']}: a different model; point checkpoint.init_from (export: --lora-base) at "
            "the base the run started from")
    return base_dir


def save_megatron_checkpoint(model, cfg: ModelConfig, ckpt_dir: str | Path, hf_config=None,
                             vision: dict | None = None) -> Path:
    """Write ``{"model": model.sharded_state_dict()}`` with ``dist_checkpointing`` (``torch_dist``), atomically.

    Collective over all ranks. Layout of ``ckpt_dir``: the ``dist_checkpointing`` files (resharding
    to any TP size on load), ``model_config.json`` (``ModelConfig`` fields; of a LLaVA ``model``: its language
    model's) and, when given, ``vision_config.json`` (``vision``: a LLaVA model's ``VisionConfig`` fields and
    ``image_token_id``) and ``hf_config.json`` (the original HF config, reused on export). On CPU it needs the cuda
    shim of ``packsft.model.cpu_compat`` and the calling script needs an ``if __name__ == "__main__"`` guard.

    Raises:
        CheckpointWriteError: a ``dist_checkpointing`` writer process failed or died (on any rank).
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    rank = global_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    process_guard.start_checkpoint_writer()     # its helper process dies with this one
    with naming_write_errors(ckpt_dir):
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp))
    barrier()
    if rank == 0:
        (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if vision is not None:
            (tmp / VISION_CONFIG_FILE).write_text(json.dumps(vision, indent=2) + "\n")
        if hf_config is not None:
            base = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
            (tmp / HF_CONFIG_FILE).write_text(json.dumps(base, indent=2, default=str) + "\n")
        write_json_atomic(tmp / FINGERPRINT_FILE, weights_fingerprint(tmp))
        replace_dir(tmp, ckpt_dir)
    barrier()
    return ckpt_dir


class CheckpointWriteError(OSError):
    """A checkpoint was not written: a ``dist_checkpointing`` writer failed or died (``str()``: one line naming the
    folder, the rank and the writer's error, e.g. a missing dependency of Megatron-Core's writer)."""


def checkpoint_write_error(err: BaseException, target: str | Path) -> CheckpointWriteError | None:
    """torch's ``CheckpointException`` from ``dist_checkpointing.save`` into ``target`` as a
    :class:`CheckpointWriteError` (None for any other exception). The rank that writes the metadata holds every
    rank's failures (a writer's ``"Worker failure: ..."``: ``process_guard.write_buckets_supervised``); the
    other ranks' exceptions are empty and point to it."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(err, CheckpointException):
        return None
    failures = getattr(err, "failures", None) or {}
    if failures:
        rank, wrapped = next(iter(failures.items()))
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        reason = f"rank {rank}: {' '.join(str(exc).split()) or type(exc).__name__}"
    else:
        reason = "a checkpoint writer failed (the error line of global rank 0 names it)"
    return CheckpointWriteError(f"cannot write checkpoint {target}: {reason}")


@contextlib.contextmanager
def naming_write_errors(target: str | Path, space_error=None) -> Iterator[None]:
    """Run a checkpoint write into ``target``; its failure is raised as ``space_error(err)`` (a full disk, when
    given and not None), else :func:`checkpoint_write_error` (a failed writer), else as it is.

    Raises:
        CheckpointSpaceError (from ``space_error``), CheckpointWriteError: chained to the write's error.
    """
    try:
        yield
    except BaseException as err:   # torch DCP's CheckpointException is a BaseException
        failed = (space_error(err) if space_error is not None else None) or checkpoint_write_error(err, target)
        if failed is None:
            raise
        raise failed from err


def unreadable_checkpoint_message(err: BaseException) -> str:
    """The ``error:`` text for torch's ``CheckpointException`` (a ``BaseException`` that wraps each rank's failure
    to read a checkpoint: a truncated or missing ``.distcp`` file, a model of another shape than the checkpoint)."""
    failures = getattr(err, "failures", None) or {}
    exc = next(iter(failures.values()))[0] if failures else err
    return f"cannot load the checkpoint: {type(exc).__name__}: {str(exc).strip()}".rstrip(": ")


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key is a LoRA adapter tensor (``...lora_A.default.weight``)."""
    return ".lora_" in key


COMMON_FILE, METADATA_FILE = "common.pt", "metadata.json"
"""``dist_checkpointing``'s files of unsharded values (read with ``weights_only=True``) and of its format."""


def load_dist_checkpoint(sharded: dict, ckpt_dir: str | Path) -> dict:
    """``dist_checkpointing.load(sharded, ckpt_dir)`` without running code from the folder
    (:func:`packsft.train.safe_checkpoint_read.load`), naming a damaged ``common.pt`` or ``metadata.json``.

    Raises:
        CheckpointError: ``.metadata``, a ``.distcp`` item, ``common.pt`` or a layer's ``_extra_state`` holds
            something that could run code (``refused``, named), ``.metadata`` is damaged, ``common.pt`` does not
            load with ``weights_only=True``, or ``metadata.json`` is not JSON.
        megatron ``CheckpointingException``, torch ``CheckpointException``: as ``dist_checkpointing.load``.
    """
    from packsft.train import safe_checkpoint_read

    try:
        return safe_checkpoint_read.load(sharded, Path(ckpt_dir))
    except Exception as err:  # noqa: BLE001 - unpickling, JSON, zip, OS errors, megatron's over other contents
        damaged = None if isinstance(err, CheckpointError) else _damaged_common_file(Path(ckpt_dir))
        if damaged is None:          # named already, or the files megatron reads whole are sound: not theirs
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, pickle.UnpicklingError):   # torch's first line suggests weights_only=False: never
            reason = "not a file torch.load(weights_only=True) reads"
    raise CheckpointError(f"checkpoint {ckpt_dir}: {damaged} cannot be loaded ({reason}); the checkpoint is damaged")


def _damaged_common_file(ckpt_dir: Path) -> str | None:
    """``metadata.json`` or ``common.pt`` of ``ckpt_dir`` when it is present but not readable (not a file, not JSON /
    not loadable with ``weights_only=True``: truncated, garbage, bytes flipped) or not a dict (``metadata.json``:
    without ``sharded_backend``), else None."""
    import torch

    for name, read in ((METADATA_FILE, read_json_object),
                       (COMMON_FILE, lambda f: torch.load(f, map_location="cpu", weights_only=True))):
        file = ckpt_dir / name
        if not file.exists():
            continue
        try:
            value = read(file)
        except Exception:  # noqa: BLE001 - any failure to read it back is the damage being named
            return name
        if not isinstance(value, dict) or (name == METADATA_FILE and "sharded_backend" not in value):
            return name
    return None


def load_megatron_checkpoint(model, ckpt_dir: str | Path, *, base_only: bool = False,
                             adapters_only: bool = False) -> None:
    """Load ``save_megatron_checkpoint``'s (or a trainer checkpoint's) ``"model"`` entry into ``model`` (any TP, PP).

    ``model``: a ``GPTModel`` or ``LLaVAModel``, or a list of them (this pipeline rank's virtual-stage chunks). A
    list is read by one ``dist_checkpointing.load`` of ``{"model": {"chunk<i>": chunk i's sharded state}}`` (the
    trainer's layout, :mod:`packsft.train.checkpoint`): the tensors' keys are global, so a one-chunk import fills
    any number of chunks, and the load must cover every chunk at once (one load per chunk fails megatron's access
    check: each reads only part of the stacked layers).
    ``base_only``: ``model`` carries LoRA adapters (``packsft.model.lora``) that the checkpoint (an imported base
    model) lacks; every other tensor is loaded strictly and the adapters keep their initial values.
    ``adapters_only``: the checkpoint is a LoRA run's (adapters only); exactly the adapters are loaded and the
    base weights are left as they are (load the base first).

    Raises:
        CheckpointError: a damaged ``common.pt`` or ``metadata.json`` (:func:`load_dist_checkpoint`).
    """
    chunks = model if isinstance(model, list) else [model]
    states = []
    for gpt in chunks:
        sharded = gpt.sharded_state_dict()
        if base_only or adapters_only:
            sharded = {k: v for k, v in sharded.items() if is_adapter_key(k) == adapters_only}
        states.append(sharded)
    request = states[0] if len(chunks) == 1 else {f"chunk{i}": s for i, s in enumerate(states)}
    loaded = load_dist_checkpoint({"model": request}, ckpt_dir)["model"]
    for i, gpt in enumerate(chunks):
        state = loaded if len(chunks) == 1 else loaded[f"chunk{i}"]
        check_partial_load(gpt.load_state_dict(state, strict=not (base_only or adapters_only)),
                           adapters_only=adapters_only, what=f"{ckpt_dir}: checkpoint")


def check_partial_load(result, *, adapters_only: bool, what: str) -> None:
    """Assert that a non-strict ``load_state_dict`` missed only the other half (base / adapters).

    ``result``: its ``(missing_keys, unexpected_keys)``; ``adapters_only``: the adapters were loaded (else the base).
    An invariant, not a check of the checkpoint: the state loaded is the model's own ``sharded_state_dict()``
    filtered by :func:`is_adapter_key`, and ``dist_checkpointing.load`` refuses a checkpoint that lacks one of its
    tensors (``CheckpointException`` naming it).
    """
    missing = [k for k in result.missing_keys if is_adapter_key(k) == adapters_only]
    assert not missing and not result.unexpected_keys, \
        f"{what} does not match the model: missing {missing}, unexpected {list(result.unexpected_keys)}"

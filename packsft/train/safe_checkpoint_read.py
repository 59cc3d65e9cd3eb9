"""Reading a ``dist_checkpointing`` (``torch_dist``) folder without running code from it.

Such a folder holds pickles, which megatron-core and torch read in ways that can run code:

* ``.metadata``: torch's index of the shards, a plain pickle (``FileSystemReader.read_metadata``:
  ``pickle.load``). Read here once by :func:`read_dcp_metadata` with :class:`MetadataUnpickler`, which admits only
  the classes that metadata is made of (:data:`METADATA_CLASSES` and torch dtypes).
* ``__*_*.distcp``: tensors, which torch reads with ``torch.load(weights_only=True)``, and non-tensor items
  (megatron ``ShardedObject``: optimizer param groups, the layers' ``_extra_state``), which torch's
  ``DefaultLoadPlanner.load_bytes`` reads with ``torch.load(weights_only=False)``. Read here with
  ``weights_only=True`` (:class:`SafeFileSystemReader`).
* ``common.pt``: megatron's ``TorchCommonLoadStrategy`` calls ``torch.load`` without ``weights_only``, so
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns it into a plain unpickle; :class:`WeightsOnlyCommonLoadStrategy`
  passes ``weights_only=True``.
* ``_extra_state`` of Transformer Engine layers: TE before 2.18 unpickles a non-empty one (FP8 scaling state) in
  ``load_state_dict``. packsft trains without FP8, so it writes only ``None`` or empty ones; any other is refused
  (:func:`check_extra_state`).

:func:`load` is ``dist_checkpointing.load`` with all of that in place: megatron's reader factory
(``megatron.core.dist_checkpointing.strategies.torch._get_filesystem_reader``, the one place its load strategy
makes torch readers) is swapped for :class:`SafeFileSystemReader` for the duration of the call. A refusal is a
:class:`CheckpointError` naming the file (``<path>: refused: ... could run code ...``); nothing from the file ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch_strategy
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from packsft.train.checkpoint_files import CheckpointError

METADATA_FILE = ".metadata"
"""torch's index of a ``torch_dist`` folder (``torch.distributed.checkpoint.filesystem._metadata_fn``)."""

_DCP = "torch.distributed.checkpoint"
METADATA_CLASSES = frozenset({
    *((f"{_DCP}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    *((f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),          # a torch.layout by its name
    # empty placeholder classes megatron-core keeps to read the metadata of checkpoints of megatron-core <= 0.15
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
})
"""``(module, name)`` of every class a ``.metadata`` may reference besides torch dtypes: torch's metadata
dataclasses and enums (``torch/distributed/checkpoint/metadata.py``, ``planner.py``, ``filesystem.py``), as
listed from the ``.metadata`` of packsft's trainer and import checkpoints (torch AdamW and Megatron's distributed
optimizer, fp32 and bf16). Each is a data holder: building one runs no code of the file's choosing."""


def refused(file: str | Path, what: str) -> CheckpointError:
    """The error for a checkpoint file that holds something that could run code: ``<file>: refused: <what>, ...``."""
    return CheckpointError(
        f"{file}: refused: {what}, which could run code when loaded. packsft never writes such files: the "
        "checkpoint was altered or not written by packsft; nothing from it was executed")


def is_refused_global(err: pickle.UnpicklingError) -> bool:
    """Whether ``torch.load(weights_only=True)`` failed on a class or function it does not admit (else: bytes that
    are no pickle torch reads, a damaged file)."""
    return "global" in str(err).lower()


def refusal_reason(err: BaseException) -> str:
    """What a ``torch.load(weights_only=True)`` error refused (``unsupported GLOBAL posix.system``; torch's hint to
    allow it is left out), else its last line."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        return f"unsupported GLOBAL {found.group(1)}"
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


PLAIN_VALUES_ONLY = "it holds objects other than tensors and plain values"


@contextlib.contextmanager
def refusing_code(file: str | Path, what: str = PLAIN_VALUES_ONLY) -> Iterator[None]:
    """Run a ``torch.load(weights_only=True)`` of ``file``; a class or function it refused becomes
    :func:`refused` (``<file>: refused: <what> (torch.load(weights_only=True): unsupported GLOBAL ...)``).

    Raises:
        CheckpointError: the refusal, naming ``file``. Other ``pickle.UnpicklingError`` (bytes that are no pickle)
            as they are.
    """
    try:
        yield
    except pickle.UnpicklingError as err:
        if not is_refused_global(err):
            raise
        raise refused(file, f"{what} (torch.load(weights_only=True): {refusal_reason(err)})") from None


class NotAdmittedError(pickle.UnpicklingError):
    """A pickle references a global (class, function) that its reader does not admit; ``qualname`` names it."""

    def __init__(self, qualname: str):
        super().__init__(f"{qualname} is not admitted")
        self.qualname = qualname


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` admitting only :data:`METADATA_CLASSES` and torch dtypes.

    Raises:
        NotAdmittedError: a global (class, function) outside them, before anything is built.
    """

    def find_class(self, module: str, name: str) -> Any:
        """The class, function or dtype ``module.name`` when admitted."""
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise NotAdmittedError(f"{module}.{name}")


def read_dcp_metadata(ckpt_dir: str | Path) -> Metadata:
    """``<ckpt_dir>/.metadata`` read with :class:`MetadataUnpickler`.

    Raises:
        CheckpointError: it references another class or function (``refused ... could run code``), or it is missing
            or not a pickle of torch's ``Metadata`` (truncated, damaged).
    """
    file = Path(ckpt_dir) / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except NotAdmittedError as err:
        raise refused(file, f"it references {err.qualname} (not one of the classes torch.distributed.checkpoint "
                            "metadata is made of)") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            ImportError, OSError) as err:   # missing, truncated, garbage, a folder in its place
        metadata = err
    if not isinstance(metadata, Metadata):
        reason = refusal_reason(metadata) if isinstance(metadata, BaseException) else f"a {type(metadata).__name__}"
        raise CheckpointError(f"{file}: unreadable (not torch.distributed.checkpoint metadata: {reason}): the "
                              "checkpoint is damaged") from None
    return metadata


class _WeightsOnlyBytes:
    """``planner`` whose ``load_bytes`` (torch: ``torch.load(weights_only=False)``) is handed only a pickle written
    here from what ``torch.load(weights_only=True)`` read: tensors and plain values."""

    def __init__(self, planner, file: Path):
        self._planner, self._file = planner, file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        what = f"its item {read_item.storage_index.fqn} holds objects other than tensors and plain values"
        with refusing_code(self._file, what):
            item = torch.load(value, map_location="cpu", weights_only=True)
        clean = io.BytesIO()
        torch.save(item, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that returns the ``.metadata`` :func:`read_dcp_metadata` read (``metadata``, or
    read on first use) and reads each ``.distcp`` item with ``torch.load(weights_only=True)``.

    Raises (``read_data``; torch wraps it in ``CheckpointException``):
        CheckpointError: an item of a ``.distcp`` file holds a class or function (the file is named).
    """

    def __init__(self, path: str | Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._dcp_metadata = metadata

    def read_metadata(self) -> Metadata:
        """The folder's ``Metadata`` (:func:`read_dcp_metadata`), read once."""
        if self._dcp_metadata is None:
            self._dcp_metadata = read_dcp_metadata(self.path)
        if getattr(self._dcp_metadata, "storage_meta", None) is None:    # as torch's read_metadata
            self._dcp_metadata.storage_meta = StorageMeta()
        self._dcp_metadata.storage_meta.load_id = self.load_id
        return self._dcp_metadata

    def read_data(self, plan, planner) -> Future[None]:
        """torch's ``read_data``, file by file, with ``planner.load_bytes`` given only weights-only contents."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():         # one file at a time, to name it
            file = Path(self.path) / name
            with refusing_code(file):   # a tensor item (torch reads those with weights_only=True)
                super().read_data(dataclasses.replace(plan, items=items), _WeightsOnlyBytes(planner, file))
        done: Future[None] = Future()
        done.set_result(None)
        return done


class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's ``common.pt`` reader with ``torch.load(weights_only=True)`` (megatron leaves it to torch's default,
    which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns off).

    Raises:
        CheckpointError: ``common.pt`` holds a class or function.
        megatron ``CheckpointingException``: no ``common.pt``. Other errors of ``torch.load`` (a damaged file) as
            they are.
    """

    def load_common(self, checkpoint_dir: str | Path):
        """The ``common.pt`` state dict of ``checkpoint_dir``."""
        file = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not file.exists():
            return super().load_common(checkpoint_dir)           # megatron's message
        with refusing_code(file):
            return torch.load(file, map_location="cpu", weights_only=True)


def check_extra_state(state: dict, ckpt_dir: str | Path, prefix: str = "") -> None:
    """Refuse an ``_extra_state`` in a loaded state dict other than ``None`` or an empty tensor (what packsft
    writes: megatron's local layers and Transformer Engine layers without FP8).

    Transformer Engine (< 2.18) unpickles a non-empty one in ``load_state_dict``.

    Raises:
        CheckpointError: naming the checkpoint and the key.
    """
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_extra_state(value, ckpt_dir, f"{name}.")
        elif str(key).endswith("_extra_state") and not (
                value is None or (isinstance(value, torch.Tensor) and value.numel() == 0)):
            shown = f"{value.numel()} bytes" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
            raise refused(ckpt_dir, f"{name} holds {shown} of layer extra state, which Transformer Engine "
                                    "unpickles when the model loads it (packsft trains without FP8 and writes none)")


@contextlib.contextmanager
def _safe_readers(ckpt_dir: Path, metadata: Metadata) -> Iterator[None]:
    """Make megatron's ``torch_dist`` load strategy read through :class:`SafeFileSystemReader` (with ``metadata``
    for ``ckpt_dir``) while the block runs."""
    original = megatron_torch_strategy._get_filesystem_reader

    def reader(checkpoint_dir, cache_metadata: bool = False) -> SafeFileSystemReader:
        same = Path(checkpoint_dir).resolve() == ckpt_dir.resolve()
        return SafeFileSystemReader(checkpoint_dir, metadata if same else None)

    megatron_torch_strategy._get_filesystem_reader = reader
    try:
        yield
    finally:
        megatron_torch_strategy._get_filesystem_reader = original


def failure_in(err: BaseException) -> BaseException:
    """The first rank's error inside torch's ``CheckpointException`` (``failures``: rank -> (error, traceback)),
    else ``err``."""
    failures = getattr(err, "failures", None) or {}
    first = next(iter(failures.values()), None)
    return first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else err


def load(sharded: dict, ckpt_dir: str | Path) -> dict:
    """``dist_checkpointing.load(sharded, ckpt_dir)`` reading nothing that can run code (see the module).

    Raises:
        CheckpointError: a file holds a class or function it may not (named), ``.metadata`` is damaged.
        megatron ``CheckpointingException``, torch ``CheckpointException``, others: as ``dist_checkpointing.load``.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    metadata = read_dcp_metadata(ckpt_dir) if (ckpt_dir / METADATA_FILE).exists() else None
    with _safe_readers(ckpt_dir, metadata):
        try:   # a Path: with a str, megatron's message for a missing common.pt fails (.iterdir() on the folder)
            loaded = dist_checkpointing.load(
                sharded, ckpt_dir, sharded_strategy=megatron_torch_strategy.TorchDistLoadShardedStrategy(),
                common_strategy=WeightsOnlyCommonLoadStrategy())   # whatever backend metadata.json names
        except BaseException as err:
            inner = failure_in(err)
            if isinstance(inner, CheckpointError):
                raise inner from None
            raise
    check_extra_state(loaded, ckpt_dir)
    return loaded

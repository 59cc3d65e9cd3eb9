"""Training and validation datasets from the config, and the per-rank micro-batch given to the model.

The loaders themselves (sampling order, data-parallel split, resumable state) are ``packsft.data.loader``'s; this
module only chooses the rows (the training sources or their mixture, the named validation sets and held-out
``split_validation_size`` shares) and turns a collated row into the model input of this context-parallel rank.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from packsft.data.context_parallel import make_packed_seq_params, slice_batch_for_cp
from packsft.data.dataset import PackedSFTDataset
from packsft.data.loader import load_loader_state_dict, loader_state_dict
from packsft.data.mixing import MixedDataset
from packsft.extras import import_extra
from packsft.layout import IGNORE_INDEX, TOKEN_KEYS, cp_partition_indices
from packsft.loss import conversation_weights
from packsft.prompt_formats import TokenizationSpec
from packsft.sidecar import SidecarError
from packsft.train.config import Config


class RowSubset(torch.utils.data.Dataset):
    """Rows ``indices`` of a dataset, with a ``fingerprint`` that names the base file and the subset.

    Args:
        base: a dataset with ``__getitem__``/``__len__`` (and optionally ``fingerprint``, ``sidecar``).
        indices: row indices into ``base``, in the order they are exposed.
        tag: distinguishes subsets in the fingerprint (``"train"``, ``"validation"``).
    """

    def __init__(self, base: Any, indices: list[int], tag: str) -> None:
        self.base, self.indices, self.tag = base, list(indices), tag
        self.sidecar = getattr(base, "sidecar", None)
        self.tokenizer = getattr(base, "tokenizer", None)
        self.path = getattr(base, "path", None)

    def __len__(self) -> int:
        """Number of rows in the subset."""
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Row ``indices[i]`` of the base dataset."""
        return self.base[self.indices[i]]

    @property
    def fingerprint(self) -> str:
        """``<base fingerprint>:<tag>:<rows>`` (checked by the loader on resume)."""
        return f"{getattr(self.base, 'fingerprint', None)}:{self.tag}:{len(self.indices)}"


def split_rows(num_rows: int, fraction: float, seed: int, field: str = "data.split_validation_size",
               path: str | None = None) -> tuple[list[int], list[int]]:
    """Seeded split of ``range(num_rows)`` into (train, validation) with ``ceil(fraction * num_rows)`` held out.

    Raises:
        ValueError: when either side would be empty, naming ``field`` (and the file ``path``).
    """
    num_val = math.ceil(fraction * num_rows)
    if not 0 < num_val < num_rows:
        of = f" of {path}" if path else ""
        raise ValueError(f"{field}={fraction} of the {num_rows} rows{of} leaves {num_val} validation and "
                         f"{num_rows - num_val} training rows; both must be > 0")
    order = np.random.default_rng(seed).permutation(num_rows)
    return sorted(order[num_val:].tolist()), sorted(order[:num_val].tolist())


def build_datasets(cfg: Config, warn=None) -> tuple[Any, dict[str, Any]]:
    """``(train, {name: validation})`` datasets of packed rows for ``cfg.data``.

    One training source is its ``PackedSFTDataset`` (or the training part of its split); several make a
    :class:`~packsft.data.mixing.MixedDataset` whose rows the trainer draws by weight. Validation sets: the files of
    ``data.validation`` (``data.validation_path`` is named ``validation``) and each source's held-out split (named
    after the source; ``validation`` for ``data.train_path``). Every file's sidecar is checked against the loader's
    configuration, so a file packed for another tokenizer, format, ``max_seq_len`` or CP size is refused by name.
    A validation file that a training source also reads is passed to ``warn`` (a ``print``-like callable; ``None``:
    no warning), once. The tokenizer is loaded once, for the first file, and shared by the others.
    ``data.backend: energon``: the ``EnergonTrainSource`` of ``data.energon.model_family``
    (:func:`packsft.train.energon_images.train_source`: text, or image-text for LLaVA) and, with
    ``data.energon.validation_split``, that split's ``EnergonValidationSet`` as ``validation``.

    Raises:
        FileNotFoundError, SidecarError: from ``PackedSFTDataset``, after the config field of the file
            (``data.train[1] ('math'): ...``).
        ValueError: from :func:`split_rows` or ``MixedDataset``; or two training sources read the same file and
            one of them holds rows out for validation (the other would train on them).
    """
    data = cfg.data
    if data.backend == "energon":
        module = energon_loader_module()
        from packsft.train.energon_images import train_source  # megatron.energon: the extra, checked above

        source, split = train_source(data, cfg.parallel, data.energon.model_family), data.energon.validation_split
        if split == source.split and warn is not None:
            warn(f"warning: data.energon.validation_split {split!r} is the training split: its loss is measured on "
                 "trained samples")
        return source, ({"validation": module.EnergonValidationSet(source, split)} if split else {})
    spec = TokenizationSpec(data.tokenizer, data.prompt_format, data.pad_token, data.chat_template)
    tokenizer: Any = data.tokenizer  # its path, loaded by the first dataset and shared by the others

    def packed(path: str, field: str) -> PackedSFTDataset:
        """The file of config ``field``; a missing file or a refused sidecar is named by the field too."""
        nonlocal tokenizer
        try:
            dataset = PackedSFTDataset(path, tokenizer, spec, data.max_seq_len, cfg.parallel.context_parallel_size,
                                       require_sidecar=data.require_sidecar,
                                       sequence_parallel_size=cfg.parallel.sequence_parallel_size,
                                       verify_rows_hash=True if data.verify_hash == "full" else None)
        except (FileNotFoundError, SidecarError) as err:
            raise type(err)(f"{field}: {err}") from None
        tokenizer = dataset.tokenizer
        return dataset

    train, validation = {}, {}
    trained: dict[tuple[int, int], tuple[str, float]] = {}  # file identity -> (a source reading it, its split)
    for k, (name, path, _, split) in enumerate(data.train_sources()):
        dataset = packed(path, "data.train_path" if data.train_path else f"data.train[{k}] ({name!r})")
        key = _file_key(dataset.path)
        if key in trained and max(split, trained[key][1]) > 0:
            raise ValueError(f"data.train: sources {trained[key][0]!r} and {name!r} read the same file {path}, and "
                             "one holds rows out for validation, which the other would train on (list the file "
                             "once; a larger weight draws it more often)")
        trained.setdefault(key, (name, split))
        if split > 0:
            field = "data.split_validation_size" if data.train_path else f"data.train[{k}].split_validation_size"
            train_rows, val_rows = split_rows(len(dataset), split, cfg.loader.seed, field, path)
            train[name] = RowSubset(dataset, train_rows, "train")
            validation["validation" if data.train_path else name] = RowSubset(dataset, val_rows, "validation")
        else:
            train[name] = dataset
    for name, path in data.validation_sources().items():       # their names differ from the held-out splits'
        validation[name] = packed(path, "data.validation_path" if data.validation_path  # (the config's rule)
                                  else f"data.validation {name!r}")
        if (key := _file_key(validation[name].path)) in trained and warn is not None:
            warn(f"warning: data.validation {name!r} is the file {path}, which the training source "
                 f"{trained[key][0]!r} trains on: its loss is measured on trained rows (to hold rows out, give "
                 "the source a split_validation_size)")
    return (next(iter(train.values())) if len(train) == 1 else MixedDataset(train)), validation


def energon_loader_module():
    """:mod:`packsft.train.energon_loader`, imported only for ``data.backend: energon``.

    Raises:
        ImportError: megatron-energon is not installed, naming the ``packsft[energon]`` extra.
    """
    import_extra("megatron.energon", "energon", "data.backend: energon")
    from packsft.train import energon_loader

    return energon_loader


def train_loader_state(loader) -> dict[str, Any]:
    """The checkpoint state of a training loader: an Energon loader's own, else ``loader_state_dict``'s."""
    return loader.state_dict() if getattr(loader, "backend", None) == "energon" else loader_state_dict(loader)


def load_train_loader_state(loader, state: dict[str, Any]) -> None:
    """Restore :func:`train_loader_state` into the same kind of loader.

    Raises:
        ValueError: the state is another ``data.backend``'s, or the loader refuses it (named).
    """
    now = getattr(loader, "backend", "packed")
    saved = state.get("backend", "packed") if isinstance(state, dict) else "packed"
    if saved != now:
        raise ValueError(f"cannot resume the data loader: the checkpoint was trained with data.backend {saved}, "
                         f"now {now}; resume with checkpoint.restore_data_order=false to restart the data order")
    if now == "energon":
        loader.load_state_dict(state)
    else:
        load_loader_state_dict(loader, state)


def _file_key(path) -> tuple[int, int]:
    """``(device, inode)`` of ``path``: the same file under two names (a link, ``..``) has one key."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def model_input(batch: dict[str, Any], cp_size: int, cp_rank: int, cp_group, device: torch.device,
                normalization: str = "token") -> dict[str, Any]:
    """This CP rank's share of one collated row, on ``device``, as ``packsft.train.token_loss.gpt_token_loss`` wants.

    Args:
        batch: ``packsft.data.collate.collate_rows`` output of one row: ``tokens``/``labels``/``position_ids`` int64
            ``[1, L]``, ``loss_mask`` float32 ``[1, L]``, ``cu_seqlens`` and ``cu_seqlens_padded`` int32 ``[n + 1]``
            (real lengths, padded offsets), ``max_seqlen`` int.
        cp_size, cp_rank, cp_group: context parallelism (``cp_group`` is ignored when ``cp_size == 1``).
        normalization: ``loss.normalization``; ``conversation`` adds the per-conversation weights.

    Returns:
        ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[1, L / cp_size]`` on ``device``,
        ``trained_index`` (int64 ``[n]``, the trained positions, computed on the host so the fused loss needs no
        device sync) and ``packed_seq_params`` (THD, global ``cu_seqlens`` and ``cu_seqlens_padded``). With
        ``conversation`` also ``loss_weight`` (fp32 ``[1, L / cp_size]``, ``1 / n_c`` at the trained tokens of
        conversation ``c``, ``n_c`` counted over the whole row: ``packsft.loss.conversation_weights``) and
        ``conversations`` (int64 scalar: the row's conversations that train a token on CP rank 0, 0 on the others,
        so each is counted once). A mixture's ``trained_tokens_by_source`` is passed on as it is (host ints); an
        image-text micro-batch's ``images`` (float32 ``[n, 3, H, W]``) are moved to ``device`` and its
        ``num_image_tokens`` / ``num_text_tokens`` (host ints) passed on (no CP: a LLaVA model runs without it).
    """
    local = slice_batch_for_cp(batch, cp_size, cp_rank)
    out = {key: local[key].to(device, non_blocking=True) for key in TOKEN_KEYS}
    trained = (local["labels"] != IGNORE_INDEX) & (local["loss_mask"] != 0)        # on the host: no device sync
    out["trained_index"] = trained.reshape(-1).nonzero().squeeze(1).to(device, non_blocking=True)
    out["packed_seq_params"] = make_packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"],
                                                      cp_group if cp_size > 1 else None,
                                                      batch.get("cu_seqlens_padded"), device=device)
    for key in ("trained_tokens_by_source", "num_image_tokens", "num_text_tokens"):
        if key in batch:
            out[key] = batch[key]
    if "images" in batch:
        out["images"] = batch["images"].to(device, non_blocking=True)
    if normalization == "conversation":
        offsets = batch.get("cu_seqlens_padded", batch["cu_seqlens"])
        weights, conversations = conversation_weights(batch["loss_mask"], batch["labels"], offsets)
        if cp_size > 1:
            weights = weights.index_select(-1, cp_partition_indices(offsets, cp_size, cp_rank))
            conversations = conversations * (cp_rank == 0)
        out["loss_weight"] = weights.to(device, non_blocking=True)
        out["conversations"] = conversations.to(device, non_blocking=True)
    return out

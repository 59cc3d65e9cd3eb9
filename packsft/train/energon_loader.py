"""``data.backend: energon``: conversations read from an Energon dataset (``energon prepare`` layout) by Energon's
savable loader, packed into rows while training, each micro-batch exactly what ``collate_rows`` makes of
``PackedSFTDataset`` rows (same keys, dtypes, shapes).

Each sample's ``json`` member is checked, converted and tokenized as the packer does it
(:func:`packsft.packing.records.parse_line`, :func:`packsft.prompt_formats.tokenize_conversation`); an invalid
sample stops the run (or is skipped) with ``dataset: shard: sample KEY: field: reason``. Energon's ``PackingDataset``
hands the task encoder buffers of ``data.energon.buffer_size`` conversations; :func:`balanced_greedy_knapsack`
groups them into rows of ``max_seq_len`` tokens (each conversation padded to :func:`packsft.layout.conversation_cost`)
and :func:`packsft.data.row.build_row` builds each row. A conversation longer than a row gets a row of its own and is
cut there, as the packed loader cuts a row (one warning per sample).

The loader's state (Energon's ``save_state_rank``, as plain values: :mod:`packsft.train.energon_state`) goes into
the trainer's checkpoints with a fingerprint (dataset files, split, tokenization, loader and packing settings,
data-parallel layout); :meth:`EnergonTrainLoader.load_state_dict` refuses a changed one by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    SkipSample,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    stateless,
)
from megatron.energon.errors import reraise_exception

from packsft.data.collate import collate_rows
from packsft.data.dataset import RowError
from packsft.data.row import build_row
from packsft.jsonl import ConversationError
from packsft.layout import conversation_cost
from packsft.packing import energon as energon_files
from packsft.packing.energon import META, PAYLOAD, dataset_above, is_energon, iter_sample_members, payload_text
from packsft.packing.records import parse_line
from packsft.packing.sources import SourceError, energon_split, source_identity
from packsft.prompt_formats import PromptFormatError, Tokenization, TokenizationSpec, tokenize_conversation
from packsft.record_formats import adapter_identity, record_converter
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint
from packsft.train.energon_state import from_plain, plain_state

STATE_KIND = "energon"
MAX_SAMPLES_PER_SEQUENCE = 100
"""Samples Energon reads in a row from one shard slice before switching (Megatron-LM's setting)."""


class EnergonSampleError(RowError):
    """A sample that cannot be trained: ``dataset: shard: sample KEY: field: reason`` (a ``RowError``: the trainer
    prints it as one ``error:`` line). Rebuilt by torch from a loader worker's text, it keeps that text's last line.
    """

    def __init__(self, text: str) -> None:
        text = str(text).rstrip().splitlines()[-1]
        for name in (f"{__name__}.EnergonSampleError: ", "EnergonSampleError: "):
            text = text.removeprefix(name)
        ValueError.__init__(self, text)
        self.path, self.line, self.field, self.reason = "", 0, "", text


def balanced_greedy_knapsack(costs: list[int], capacity: int, delta: int = 0,
                             max_per_bin: int | None = None) -> list[list[int]]:
    """Group item indices into bins of at most ``capacity``, spreading the fill (Megatron-LM's balanced greedy
    knapsack): ``ceil(sum / capacity) + delta`` bins are opened, the items taken from the largest down, each put
    into the emptiest bin that has room (and fewer than ``max_per_bin`` items), a new bin opened when none has.

    An item above ``capacity`` gets a bin of its own. Returns the non-empty bins, each its indices in placing order.
    """
    order = sorted(range(len(costs)), key=lambda i: costs[i], reverse=True)
    count = -(-sum(min(c, capacity) for c in costs) // capacity) + delta
    bins: list[list[int]] = [[] for _ in range(count)]
    fill = [0] * count
    for i in order:
        room = [b for b in range(len(bins)) if fill[b] + costs[i] <= capacity
                and (max_per_bin is None or len(bins[b]) < max_per_bin)]
        if not room:
            bins.append([])
            fill.append(0)
            room = [len(bins) - 1]
        best = min(room, key=lambda b: (fill[b], b))
        bins[best].append(i)
        fill[best] += costs[i]
    return [b for b in bins if b]


@stateless
def _crude(sample: dict) -> dict:
    """Cooker of ``CrudeWebdataset`` samples: the raw members, decoded by :meth:`ConversationEncoder.encode_sample`."""
    return sample


class ConversationEncoder(DefaultTaskEncoder):
    """Energon task encoder: sample -> ``{tokens, targets}`` -> packed rows -> ``collate_rows`` micro-batch.

    Args:
        dataset: the dataset folder (named in errors).
        tokenization: tokenizer and bound prompt format (the packer's tokenization of each conversation).
        max_seq_len, context_parallel_size: the row length ``L`` and CP size (conversation padding).
        delta, max_per_bin: :func:`balanced_greedy_knapsack`'s.
        record_format, convert: the records' format and ``packsft.record_formats.record_converter``'s function
            for it (or the adapter's), None for ``messages`` records.
        skip_invalid: print a warning about an invalid sample (the error's text, ``; skipped``) and skip it,
            instead of stopping the run.
        endless: for a loader that repeats the split: a run of skipped samples (none valid between them) that holds
            every sample its loader worker reads (``worker_samples``, :class:`EnergonTrainLoader` sets it) stops
            the run all the same (nothing to train). Counted by distinct sample, not in a row: the shuffle buffer
            holds each sample of a small split many times. Not endless (a validation set, read once): never.
        oversize: a conversation longer than ``max_seq_len``: ``own-row`` (cut in a row of its own), ``drop``
            (skipped, printed as an invalid one is) or ``error`` (the run stops).
    """

    cookers = (Cooker(_crude),)
    decoder = None  # members stay bytes: the json member is parsed here, as the packer parses it
    members_read = PAYLOAD
    """The members :class:`EnergonValidationSet` reads of each sample (None: all of them)."""

    def __init__(self, dataset: str, tokenization: Tokenization, max_seq_len: int, context_parallel_size: int = 1,
                 delta: int = 0, max_per_bin: int | None = None, record_format: str = "messages",
                 convert: Callable[[Any], Any] | None = None, skip_invalid: bool = False,
                 endless: bool = False, oversize: str = "own-row") -> None:
        super().__init__()
        self.dataset, self.tokenization = dataset, tokenization
        self.record_format, self.convert, self.skip_invalid = record_format, convert, skip_invalid
        self.endless, self.oversize = endless, oversize
        self.worker_samples: tuple[int, ...] = ()    # :func:`worker_sample_counts`; empty: not known, never stops
        self._skipped_run: set[str] = set()
        self.max_seq_len, self.cp, self.delta, self.max_per_bin = max_seq_len, context_parallel_size, delta, max_per_bin
        self._cut: set[str] = set()

    @stateless
    def encode_sample(self, sample: dict) -> dict:
        """``{__key__, __restore_key__, where, tokens, targets}`` of one sample.

        Raises:
            EnergonSampleError: no or undecodable ``json`` member, invalid JSON or record, media, or a conversation
                the prompt format cannot tokenize (or, with ``oversize: error``, longer than a row); with
                ``skip_invalid`` (``oversize: drop``), Energon's ``SkipSample`` after a printed warning, unless the
                run of skipped samples it ends holds every sample of its loader worker (``endless``).
        """
        sources = sample.get("__sources__") or ()
        shard = sources[0].shard_name if sources else sample.get("__shard__", "?")
        where = f"{self.dataset}: {shard}: sample {sample['__key__']}"
        _, text, problem = payload_text(sample.get(PAYLOAD), None)
        if PAYLOAD not in sample and (members := sorted(k for k in sample if not k.startswith("__"))):
            problem += f" (its members: {', '.join(members)}; a sample KEY holds KEY.{PAYLOAD})"
        try:
            encoded = self.encode_record(sample, text, problem)
            tokens = encoded["tokens"]
        except (ConversationError, PromptFormatError) as err:
            field, reason = (err.field, err.reason) if isinstance(err, ConversationError) else ("messages", err)
            problem, skip, setting = f"{field + ': ' if field else ''}{reason}", self.skip_invalid, None
        else:
            if len(tokens) <= self.max_seq_len or self.oversize == "own-row":
                self._skipped_run.clear()
                return {"__key__": sample["__key__"], "__restore_key__": sample["__restore_key__"], "where": where,
                        **encoded}
            problem = f"{len(tokens)} tokens, more than data.max_seq_len ({self.max_seq_len})"
            skip, setting = self.oversize == "drop", f"oversize: {self.oversize}"
        if skip and self.endless:
            self._skipped_run.add(where)
        worker = WorkerConfig.active_worker_config
        count = self.worker_samples[worker.rank_worker_id() if worker else 0] if self.worker_samples else 0
        if skip and not (self.endless and 0 < count <= len(self._skipped_run)):
            print(f"warning: {where}: {problem}; skipped (data.energon.{setting or 'skip_invalid_samples'})",
                  file=sys.stderr, flush=True)
            raise SkipSample()
        who, fix = ("this loader worker", " or lower data.energon.num_workers") if worker and worker.num_workers \
            else ("this rank's loader", "")
        raise EnergonSampleError(f"{where}: {problem}" + (
            f"; every one of the {count} samples {who} reads was skipped, no valid one between them: nothing to "
            f"train; fix the samples{fix}" if skip else
            f" (data.energon.{setting}; own-row cuts it, drop skips it)" if setting else ""))

    def encode_record(self, sample: dict, text: str | None, problem: str | None) -> dict:
        """``{tokens, targets}`` of one sample's ``json`` member (``text``, or ``problem`` why there is none): the
        packer's parse and tokenization (a subclass adds its own keys: :mod:`packsft.train.energon_images`).

        Raises:
            ConversationError, PromptFormatError: as :meth:`encode_sample` reports them.
        """
        conv, _, _ = parse_line(self.dataset, 0, text, problem, self.convert, self.record_format, text_only=True)
        tokens, targets = tokenize_conversation(conv.messages, self.tokenization, conv.tools,
                                                conv.chat_template_kwargs)
        return {"tokens": tokens, "targets": targets}

    def select_samples_to_pack(self, samples: list[dict]) -> list[list[dict]]:
        """The rows of one buffer: :func:`balanced_greedy_knapsack` over the conversations' costs."""
        costs = [int(conversation_cost(len(s["tokens"]), self.cp)) for s in samples]
        bins = balanced_greedy_knapsack(costs, self.max_seq_len, self.delta, self.max_per_bin)
        return [[samples[i] for i in b] for b in bins]

    @stateless
    def pack_selected_samples(self, samples: list[dict]) -> dict:
        """One row of :func:`packsft.data.row.build_row`; a conversation longer than a row is cut (warned once)."""
        row, truncation = build_row([(s["tokens"], s["targets"]) for s in samples],
                                    self.tokenization.fmt.pad_token_id, self.max_seq_len, self.cp)
        if truncation is not None and samples[0]["where"] not in self._cut:
            self._cut.add(samples[0]["where"])
            warnings.warn(f"{samples[0]['where']}: right-truncated to max_seq_len: {truncation.describe()}",
                          UserWarning, stacklevel=2)
        return row

    @stateless
    def batch(self, samples: list[dict]) -> dict:
        """``collate_rows`` of ``loader.micro_batch_size`` rows."""
        return collate_rows(samples)


class EnergonTrainSource:
    """The training data of ``data.backend: energon``: the dataset, its split and the tokenization, checked.

    Attributes: ``path``, ``split``, ``tokenizer`` (loaded), ``tokenization``, ``identity``
    (:func:`packsft.packing.sources.source_identity`: files, sizes, BLAKE2b of the metadata files and of each
    shard's sample index, not of the shards themselves), ``sidecar`` (None).

    Raises:
        ValueError: the folder is not a usable Energon dataset or split (naming ``data.train_path``), or the
            prompt format cannot be bound to the tokenizer.
    """

    sidecar = None
    encoder_class: Callable[..., ConversationEncoder] = ConversationEncoder
    """What :meth:`encoder` builds (a subclass's own encoder: :mod:`packsft.train.energon_images`)."""
    summary_key = "train_samples"
    """The run summary reports ``len(source)`` as ``train_samples``: rows are packed from them as they are read."""

    def __init__(self, data, parallel) -> None:
        self.data, self.parallel = data, parallel
        self.path = str(Path(data.train_path).resolve())
        if not is_energon(self.path):
            root = dataset_above(self.path)
            why = (f"part of the Energon dataset {root}; give the dataset's folder" if root else
                   "no such file or folder" if not Path(self.path).exists() else
                   "not an Energon dataset (no .nv-meta/ folder): give the folder energon prepare made, or train "
                   ".jsonl.packed files with data.backend: packed")
            raise ValueError(f"data.train_path: {self.path}: {why}")
        key = "data.split="
        try:
            self.split = energon_split(self.path, data.split)
            self.identity = source_identity(self.path, self.split, shard_index_only=True)
            key = "data.energon.validation_split="
            if data.energon.validation_split is not None:
                energon_split(self.path, data.energon.validation_split)
        except SourceError as err:   # the packer's words for its flags, here the config's keys
            text = str(err).replace("--split ", key).replace("--input ", "")
            raise ValueError(f"data.train_path: {text}") from None
        described = Path(self.path) / META / "dataset.yaml"
        found = (yaml.safe_load(described.read_text()) or {}) if described.is_file() else {}
        kind = found.get("__class__") or (found.get("sample_type") or {}).get("__class__")  # energon 7: nested
        if kind != "CrudeWebdataset":
            kind = f"the sample type {kind}" if kind else "no sample type (no dataset.yaml)"
            raise ValueError(f"data.train_path: {self.path} was prepared with {kind}; the trainer reads each "
                             "sample's json member as it comes: prepare it again with energon prepare "
                             f"{self.path} --sample-type CrudeWebdataset --force-overwrite")
        self.convert = record_converter(data.energon.record_format, data.energon.adapter, "data.energon.adapter=")
        self.tokenizer = load_tokenizer(data.tokenizer)
        spec = TokenizationSpec(data.tokenizer, data.prompt_format, data.pad_token, data.chat_template)
        self.tokenization = Tokenization.of(self.tokenizer, spec.bind(self.tokenizer))

    def __len__(self) -> int:
        """Samples in the split (the summary's ``train_samples``)."""
        return int(self.identity["num_samples"])

    def settings(self, loader, dp_size: int) -> dict[str, Any]:
        """The settings a loader state depends on, by config key (the fingerprint's comparable part)."""
        d, e = self.data, self.data.energon
        return {"data.tokenizer (its vocabulary and special tokens)": tokenizer_fingerprint(self.tokenizer),
                "data.prompt_format": d.prompt_format, "data.pad_token": d.pad_token,
                "data.chat_template (the template's text, SHA-256)": self.tokenization.fmt.template_sha256,
                "data.max_seq_len": d.max_seq_len,
                "parallel.context_parallel_size": self.parallel.context_parallel_size,
                **{f"data.energon.{f.name}": getattr(e, f.name) for f in dataclasses.fields(e)
                   if f.name != "validation_split"},     # validation does not move the training data
                "data.energon.adapter (SHA-256 of its source)":
                    e.adapter and adapter_identity(e.adapter)["adapter_sha256"],
                "loader.micro_batch_size": loader.micro_batch_size, "loader.seed": loader.seed,
                "data-parallel size": dp_size}

    def train_loader(self, loader, dp_rank: int, dp_size: int) -> EnergonTrainLoader:
        """This data-parallel rank's :class:`EnergonTrainLoader` (``loader``: the ``DataLoaderConfig``)."""
        return EnergonTrainLoader(self, loader, dp_rank, dp_size)

    def encoder(self, endless: bool = True) -> ConversationEncoder:
        """The :class:`ConversationEncoder` of the ``data`` and ``parallel`` settings; ``endless``: for a loader
        that repeats the split (a run of skipped samples holding all its worker's samples stops it)."""
        e = self.data.energon
        return self.encoder_class(self.path, self.tokenization, self.data.max_seq_len,
                                   self.parallel.context_parallel_size, e.balanced_knapsack_delta,
                                   e.max_sequences_per_bin, e.record_format, self.convert, e.skip_invalid_samples,
                                   endless, e.oversize)


class EnergonValidationSet:
    """Every sample of one split in the shards' order (excluded ones left out), tokenized and packed once with the
    training encoder's knapsack over the whole split: map-style rows, as ``PackedSFTDataset``'s, for the trainer's
    evaluation loader.

    Raises:
        EnergonSampleError: a sample that cannot be trained (dataset, shard, key).
    """

    sidecar = None
    too_few_rows = "give a split with at least dp_size packed rows, or set data.energon.validation_split=null"
    """What to do when there are fewer rows than data-parallel ranks (``samplers.num_rows_of`` says it)."""

    def __init__(self, source: EnergonTrainSource, split: str) -> None:
        self.path, self.split, self.encoder = source.path, split, source.encoder(endless=False)  # read once
        self.named = f"data.energon.validation_split {split!r} ({source.path})"
        samples = []
        for _, shard, key, members in iter_sample_members(source.path, split, self.encoder.members_read):
            with contextlib.suppress(SkipSample):    # skip_invalid_samples: warned
                samples.append(self.encoder.encode_sample({"__key__": key, "__restore_key__": None, "__shard__": shard,
                                                           **members}))
        if not samples:
            raise ValueError(f"data.energon.validation_split {split!r}: no valid sample to validate on (each was "
                             "skipped: data.energon.skip_invalid_samples)")
        self.rows = self.encoder.select_samples_to_pack(samples)

    def __len__(self) -> int:
        """Packed rows."""
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        """Row ``i`` (:func:`packsft.data.row.build_row`)."""
        return self.encoder.pack_selected_samples(self.rows[i])

    def collate(self, rows: list[dict]) -> dict:
        """The micro-batch of ``rows`` as the training loader makes it (the encoder's ``batch``: ``collate_rows``,
        plus the images of an image-text set): the evaluation loader's ``collate_fn``."""
        return self.encoder.batch(rows)


class EnergonTrainLoader:
    """Endless micro-batches of one data-parallel rank from Energon's ``SavableDataLoader``, and its state.

    Energon splits the split's samples over ``dp_size`` ranks (``WorkerConfig(rank=dp_rank, world_size=dp_size)``)
    and their ``data.energon.num_workers`` workers; ``loader.seed`` is Energon's ``seed_offset``.
    """

    backend = STATE_KIND

    def __init__(self, source: EnergonTrainSource, loader, dp_rank: int, dp_size: int) -> None:
        e = source.data.energon
        self.dp_rank, self.fingerprint = dp_rank, {"dataset": source.identity,
                                                   "settings": source.settings(loader, dp_size)}
        config = WorkerConfig(rank=dp_rank, world_size=dp_size, num_workers=e.num_workers, seed_offset=loader.seed,
                              global_error_handler=reraise_exception)
        encoder = source.encoder()
        dataset = get_train_dataset(source.path, split_part=source.split, worker_config=config,
                                    batch_size=loader.micro_batch_size, packing_buffer_size=e.buffer_size,
                                    shuffle_buffer_size=e.shuffle_buffer_size,
                                    max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE,
                                    virtual_epoch_length=e.virtual_epoch_length, task_encoder=encoder)
        raw = sum(shard.count for shard in energon_files.split_meta(source.path, source.split).shards)
        encoder.worker_samples = worker_sample_counts(dataset, e.num_workers, raw - len(source))
        in_process = e.num_workers == 0   # no gc.freeze nor watchdog in the trainer's own process
        self.loader = get_savable_loader(dataset, gc_collect_every_n_steps=0 if in_process else 10,
                                         watchdog_timeout_seconds=None if in_process else 60)

    def __iter__(self):
        """Micro-batches forever (Energon's virtual epochs one after another)."""
        while True:
            empty = True
            for batch in self.loader:
                empty = False
                yield batch
            if empty:
                raise ValueError("the Energon loader yielded no micro-batch in a whole epoch")

    def state_dict(self) -> dict[str, Any]:
        """``{backend, dp_rank, fingerprint, state}``: plain values (``torch.load(weights_only=True)`` reads them)."""
        return {"backend": STATE_KIND, "dp_rank": self.dp_rank, "fingerprint": self.fingerprint,
                "state": plain_state(self.loader.save_state_rank())}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` before the first ``iter()``; the next micro-batch is the one that followed.

        Raises:
            ValueError: its fingerprint differs (each change named: a setting by its config key, a dataset file by
                name).
        """
        changes = fingerprint_changes(saved.get("fingerprint") or {}, self.fingerprint)
        if saved.get("dp_rank") != self.dp_rank:
            changes.append(f"data-parallel rank: checkpoint {saved.get('dp_rank')}, now {self.dp_rank}")
        if changes:
            raise ValueError("cannot resume the Energon data loader exactly: " + "; ".join(changes) + ". To keep "
                             "the weights and optimizer but restart the data order, resume with "
                             "checkpoint.restore_data_order=false")
        self.loader.restore_state_rank(from_plain(saved["state"]))


def worker_sample_counts(dataset, num_workers: int, excluded: int) -> tuple[int, ...]:
    """Samples each of this rank's ``num_workers`` loader workers reads (one entry for 0 workers): ``len_worker``
    of Energon's innermost dataset (the worker's slices of the split's shards), less the split's ``excluded``
    samples (``split.yaml``'s, in whichever worker's slices), at least 1 where there are any."""
    while hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return tuple(min(n, max(1, n - excluded)) for n in (dataset.len_worker(w) for w in range(max(1, num_workers))))


def fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two loader fingerprints: settings by key (of a dict-valued one, such as the
    processor's, only the sub-keys that differ: ``KEY: SUB old -> new; SUB.SUB old -> new``), then the dataset
    (split, sample count, each file changed, new or gone)."""
    was, cur = saved.get("settings", {}), now["settings"]
    changes = [f"{k}: " + ("; ".join(_differences(was[k], cur[k])) if isinstance(was.get(k), dict) and
                           isinstance(cur.get(k), dict) else f"checkpoint {was.get(k)!r}, now {cur.get(k)!r}")
               for k in cur if was.get(k) != cur.get(k)]
    old, new = saved.get("dataset", {}), now["dataset"]
    for key in ("split", "num_samples"):
        if old.get(key) != new.get(key):
            changes.append(f"the dataset's {key}: checkpoint {old.get(key)!r}, now {new.get(key)!r}")
    old_files = {f["name"]: f for f in old.get("files", [])}
    new_files = {f["name"]: f for f in new["files"]}
    changes += [f"the dataset file {n} changed (size, BLAKE2b or sample index)" for n in new_files
                if n in old_files and old_files[n] != new_files[n]]
    changes += [f"the dataset file {n} is new" for n in new_files if n not in old_files]
    changes += [f"the dataset file {n} is gone" for n in old_files if n not in new_files]
    return changes


def _differences(was: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``SUB old -> new`` for each sub-key (dotted below a nested dict) whose value differs between two dict-valued
    settings; a string shown bare, a missing key as ``(none)``."""
    def shown(d: dict[str, Any], k: str) -> str:
        return "(none)" if k not in d else d[k] if isinstance(d[k], str) else repr(d[k])

    out = []
    for k in dict.fromkeys([*now, *was]):
        if isinstance(was.get(k), dict) and isinstance(now.get(k), dict):
            out += _differences(was[k], now[k], f"{prefix}{k}.")
        elif k not in was or k not in now or was[k] != now[k]:
            out.append(f"{prefix}{k} {shown(was, k)} -> {shown(now, k)}")
    return out

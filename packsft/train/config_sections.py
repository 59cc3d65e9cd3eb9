"""The sections of the training configuration (``data``, ``loss``, ``scheduler``, ``parallel``, ``train``,
``checkpoint``, ``logging``, ``validation``): dataclasses whose fields declare their rules and whose ``__post_init__``
checks them (:func:`~packsft.config_rules.check_fields`), raising ``ValueError`` naming the dotted key and the value.
:mod:`packsft.train.config` assembles them (with ``model``, ``loader``, ``optimizer`` and ``lora``) into
:class:`~packsft.train.config.Config` and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from omegaconf import MISSING

from packsft.config_rules import (
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    Exclusive,
    Needs,
    at_most,
    check_fields,
    gt,
    in_range,
    one_of,
    rules,
)
from packsft.prompt_formats import ALIASES, PRESETS

DECAY_STYLES = ("cosine", "linear", "constant")
VERIFY_HASH = ("auto", "full")
AUTOCAST_DTYPES = ("bfloat16", "float16")
LOSS_NORMALIZATIONS = ("token", "conversation")
MIXTURE_UNITS = ("rows", "trained_tokens")
DATA_BACKENDS = ("packed", "energon")
ENERGON_RECORD_FORMATS = ("messages", "sharegpt", "alpaca")
ENERGON_MODEL_FAMILIES = ("llava",)


@dataclass
class TrainSourceConfig:
    """One packed training file of ``data.train`` (a mixture when there are several)."""

    path: str = MISSING
    """The ``.jsonl.packed`` file (with its sidecar)."""
    name: str | None = None
    """Name in logs, checkpoints and errors; default: the file name without ``.jsonl.packed``."""
    weight: float = field(default=1.0, metadata=rules(gt(0)))
    """Share of the training rows drawn from this source, normalised over the sources (``[7, 3]`` is ``[0.7, 0.3]``)."""
    split_validation_size: float = field(default=0.0, metadata=rules(in_range(0, 1)))
    """Fraction in [0, 1) of this source's rows held out as the validation set ``<name>`` (seeded by
    ``loader.seed``)."""


@dataclass
class ValidationSourceConfig:
    """One named validation file of ``data.validation``."""

    path: str = MISSING
    name: str | None = None
    """Logged as ``val_loss/<name>``; default: the file name without ``.jsonl.packed``."""


def _source_name(name: str | None, path: str) -> str:
    return name or Path(path).name.removesuffix(".packed").removesuffix(".jsonl")


_MIXTURE_ONLY = (
    ("samples_per_epoch", None, "sets the epoch of a mixture of several data.train sources; with one source an epoch "
                                "is all its rows"),
    ("mixture_unit", "rows", "sets what the weights of a mixture of several data.train sources share out; with one "
                             "source there is nothing to share"),
)
"""``DataConfig`` fields that only a mixture of several ``data.train`` sources reads: ``(field, default, what it
sets)``."""


@dataclass
class EnergonConfig:
    """How ``data.backend: energon`` reads and packs its dataset (:mod:`packsft.train.energon_loader`)."""

    num_workers: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Energon loader worker processes per data-parallel rank (0: read in the trainer process)."""
    shuffle_buffer_size: int = field(default=100, metadata=rules(*POSITIVE))
    """Samples in Energon's shuffle buffer (1: the shards' sample order, no shuffle)."""
    virtual_epoch_length: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Packed rows per Energon virtual epoch (0: none); the trainer draws on across epochs."""
    buffer_size: int = field(default=100, metadata=rules(*POSITIVE))
    """Conversations packed together: each buffer of this many is packed into rows at once."""
    max_sequences_per_bin: int | None = field(default=None, metadata=rules(*POSITIVE))
    """At most this many conversations in one row (null: no limit)."""
    balanced_knapsack_delta: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Rows opened beyond ``ceil(tokens / max_seq_len)`` of a buffer before packing: more spreads its conversations
    over more, emptier rows (balanced greedy knapsack)."""
    record_format: str = field(default="messages", metadata=rules(one_of(ENERGON_RECORD_FORMATS)))
    """What each sample's ``json`` member holds: ``messages`` (OpenAI), ``sharegpt`` or ``alpaca`` records,
    converted as the packer's ``--format`` converts them."""
    adapter: str | None = None
    """Import path ``pkg.module:fn`` (or ``path/to/file.py:fn``) of a function turning one record into
    ``{"messages": [...], "tools"?: [...]}``, as the packer's ``--adapter`` (with ``record_format: messages``); the
    SHA-256 of its file, or of every file of its top-level package, is part of the loader's fingerprint."""
    oversize: str = field(default="own-row", metadata=rules(one_of(("own-row", "drop", "error"))))
    """A conversation longer than ``data.max_seq_len``: ``own-row`` (cut in a row of its own, warned once), ``drop``
    (skipped, with a printed warning naming it) or ``error`` (the run stops naming it): the packer's ``--oversize``."""
    skip_invalid_samples: bool = False
    """Warn about an invalid sample (naming dataset, shard, key and field) and skip it; false: it stops the run."""
    validation_split: str | None = None
    """A split of ``data.train_path`` (e.g. ``val``) validated as the set ``validation``: every sample, packed once
    at start (null: no validation set)."""
    model_family: str | None = field(default=None, metadata=rules(one_of(ENERGON_MODEL_FAMILIES)))
    """null: text conversations; ``llava``: image-text samples for a LLaVA-1.5 model (the ``vision:`` section;
    ``data.tokenizer`` is its processor's folder)."""

    relations: ClassVar = (
        Needs("adapter", ("record_format", "messages"), "an adapter replaces the record format"),
    )

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("data.energon", self)


_PACKED_ONLY = ("train", "validation", "validation_path", "split_validation_size", "samples_per_epoch",
                "require_sidecar")
"""``DataConfig`` fields that ``data.backend: energon`` does not read (set, they are refused)."""


def refuse_packed_loader_settings(loader) -> None:
    """With ``data.backend: energon``: refuse a ``loader`` section (``DataLoaderConfig``) that sets what only the
    packed rows' loader reads (its sampler, workers, balance); ``micro_batch_size`` and ``seed`` are read.

    Raises:
        ValueError: naming the first such key and where Energon's loader is set.
    """
    default = type(loader)()
    for key in ("sampler", "sampler_class_path", "sampler_kwargs", "num_workers", "persistent_workers", "balance"):
        if getattr(loader, key) != getattr(default, key):
            raise ValueError(f"loader.{key} is not read with data.backend: energon (Energon's loader reads and "
                             "shuffles the samples: set data.energon.num_workers, shuffle_buffer_size, ...)")


@dataclass
class DataConfig:
    """Packed input files and how to tokenize them (must match the packer's settings, checked via the sidecar)."""

    backend: str = field(default="packed", metadata=rules(one_of(DATA_BACKENDS)))
    """``packed``: ``.jsonl.packed`` files; ``energon``: ``train_path`` is a folder prepared by ``energon prepare``,
    read and packed while training (``data.energon``)."""
    split: str | None = None
    """With ``backend: energon``: the dataset's split to train on (null: ``train``)."""
    energon: EnergonConfig | None = field(default_factory=EnergonConfig)
    """With ``backend: energon``: the loader and packing settings (null: the defaults; with ``backend: packed``,
    ``data.energon=null`` drops a file's ``energon:`` block from the command line)."""
    train: list[TrainSourceConfig] = field(default_factory=list)
    """Training sources ``[{name, path, weight, split_validation_size}]``; several make a weighted mixture."""
    train_path: str | None = None
    """A single training file: the same as ``train: [{path: ...}]``."""
    tokenizer: str = MISSING
    """Local tokenizer folder or ``tokenizer.json`` (the one the file was packed with)."""
    max_seq_len: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """Tokens per packed row ``L``; a multiple of ``2 * parallel.context_parallel_size`` when CP > 1."""
    prompt_format: str = field(default="chat-template", metadata=rules(one_of((*PRESETS, *ALIASES))))
    """``chat-template``, ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned`` or ``passthrough``."""
    chat_template: str | None = None
    """Jinja string or file for ``chat-template`` (default: the tokenizer's)."""
    pad_token: str | None = None
    """Pad token override, as given to the packer."""
    require_sidecar: bool = False
    """Refuse a packed file without ``<file>.meta.json`` instead of warning."""
    verify_hash: str = field(default="auto", metadata=rules(one_of(VERIFY_HASH)))
    """How the packed files (rows, token cache) are checked against their sidecar at start: ``auto`` hashes a file
    of at most 256 MiB whole and checks a larger one only by size (a token cache file also by the BLAKE2b of its
    first and last MiB); ``full`` hashes every file whole (about 1 GB/s)."""
    validation: list[ValidationSourceConfig] = field(default_factory=list)
    """Named validation files ``[{name, path}]``, each evaluated and logged on its own."""
    validation_path: str | None = None
    """A single validation file: the same as ``validation: [{name: validation, path: ...}]``."""
    split_validation_size: float = field(default=0.0, metadata=rules(in_range(0, 1)))
    """With ``train_path``: fraction in [0, 1) of its rows held out for validation (seeded by ``loader.seed``)."""
    samples_per_epoch: int | None = field(default=None, metadata=rules(*POSITIVE))
    """Rows per epoch of a mixture (default: all rows of all sources); each source gets its weight's share."""
    mixture_unit: str = field(default="rows", metadata=rules(one_of(MIXTURE_UNITS)))
    """What a mixture's weights share out: ``rows`` (default), or ``trained_tokens``: each source's rows are drawn in
    proportion to weight / its mean trained tokens per row (from its token cache), so its share of the trained
    tokens is its weight."""

    relations: ClassVar = (
        Exclusive("train", "train_path"),
        Exclusive("validation", "validation_path"),
        Exclusive("validation_path", "split_validation_size"),
        Exclusive("train", "split_validation_size", "with data.train give each source its own split_validation_size"),
    )

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("data", self)
        self._check_backend()
        for i, source in enumerate(self.train):
            check_fields(f"data.train[{i}]", source)
        for key, default, what in _MIXTURE_ONLY:   # set with one source, it was ignored
            if getattr(self, key) != default and (self.train_path or len(self.train) == 1):
                raise ValueError(f"data.{key} ({getattr(self, key)}) {what}")
        held_out = [("validation" if self.train_path else n) for n, _, _, split in self.train_sources() if split > 0]
        given = [_source_name(v.name, v.path) for v in self.validation] + ["validation"] * bool(self.validation_path)
        for kind, names, hint in (                              # lists, not validation_sources() (a dict)
                ("data.train", [n for n, *_ in self.train_sources()], ""),
                ("data.validation", held_out + given, "; a source's held-out split is named after the source")):
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{kind}: names must be unique, {dupes} appear twice (set name: per entry{hint})")

    def _check_backend(self) -> None:
        """Refuse settings the chosen ``backend`` does not read."""
        if self.backend == "packed":
            if self.split is not None or self.energon not in (None, EnergonConfig()):
                key = "data.split" if self.split is not None else "data.energon"
                raise ValueError(f"{key} is read only with data.backend: energon (data.backend is packed; "
                                 f"{key}=null drops it)")
            return
        self.energon = self.energon or EnergonConfig()
        for key in _PACKED_ONLY:
            if getattr(self, key) not in (None, False, 0.0, []):
                raise ValueError(f"data.{key} is not read with data.backend: energon (one Energon dataset in "
                                 "data.train_path; validation: data.energon.validation_split); remove it")
        if not self.train_path:
            raise ValueError("data.backend: energon needs data.train_path: the folder prepared by energon prepare")

    def train_sources(self) -> list[tuple[str, str, float, float]]:
        """``(name, path, weight, split_validation_size)`` of every training source."""
        if self.train_path:
            return [(_source_name(None, self.train_path), self.train_path, 1.0, self.split_validation_size)]
        return [(_source_name(s.name, s.path), s.path, float(s.weight), s.split_validation_size) for s in self.train]

    def validation_sources(self) -> dict[str, str]:
        """``{name: path}`` of the validation files."""
        if self.validation_path:
            return {"validation": self.validation_path}
        return {_source_name(v.name, v.path): v.path for v in self.validation}

    @property
    def has_validation(self) -> bool:
        """True when a validation file, a held-out split or an Energon validation split is configured."""
        return (bool(self.validation_sources()) or any(split > 0 for *_, split in self.train_sources())
                or getattr(self.energon, "validation_split", None) is not None)


@dataclass
class LossConfig:
    """Token cross-entropy, normalised over the whole global batch per trained token or per conversation
    (``docs/loss.md``)."""

    fused_linear_cross_entropy: bool = True
    """True: packsft's chunked fused linear-CE (never holds ``[t, v]`` logits); False: Megatron's stock
    ``vocab_parallel_cross_entropy`` on full logits."""
    chunk_size: int = field(default=1024, metadata=rules(*POSITIVE))
    """Tokens per chunk of the fused loss; with vocabulary blocks of ``b = min(32768, vocab / tp)`` rows, its
    buffers are about ``chunk_size * b * (4 + 2e)`` bytes (``e`` = 2 for bf16 inputs, 0 for fp32; ``docs/loss.md``)."""
    normalization: str = field(default="token", metadata=rules(one_of(LOSS_NORMALIZATIONS)))
    """``token``: the mean over the trained tokens of the global batch; ``conversation``: each conversation's mean
    over its trained tokens, averaged over the global batch's conversations that train a token (training and
    validation alike)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``chunk_size`` or an unknown ``normalization``."""
        check_fields("loss", self)


@dataclass
class SchedulerConfig:
    """Learning rate per optimizer step: linear warmup from 0, then decay to ``min_lr``."""

    warmup_steps: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Steps of linear warmup (lr = lr * (step + 1) / warmup_steps)."""
    decay_style: str = field(default="cosine", metadata=rules(one_of(DECAY_STYLES)))
    """``cosine``, ``linear`` or ``constant``."""
    decay_steps: int | None = field(default=None, metadata=rules(*POSITIVE))
    """Steps of decay after warmup; default ``train.train_steps - warmup_steps``. After it lr stays ``min_lr``."""
    min_lr: float = field(default=0.0, metadata=rules(*NON_NEGATIVE))
    """Final learning rate."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("scheduler", self)


@dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is ``WORLD_SIZE / (tensor * context * pipeline)``."""

    tensor_model_parallel_size: int = field(default=1, metadata=rules(*POSITIVE))
    context_parallel_size: int = field(default=1, metadata=rules(*POSITIVE))
    pipeline_model_parallel_size: int = field(default=1, metadata=rules(*POSITIVE))
    """Pipeline stages ``P``: the layers are split over ``P`` ranks and each step runs Megatron-Core's 1F1B schedule
    (``get_forward_backward_func``) over the micro-batches; needs ``model.num_layers`` a multiple of ``P`` (times the
    virtual stages)."""
    virtual_pipeline_model_parallel_size: int | None = field(default=None, metadata=rules(*POSITIVE))
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B schedule); null: not interleaved. Needs ``P > 1``
    and micro-batches per step a multiple of ``P``."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (norms and residual stream split over the TP group); needs TP > 1 and
    ``data.max_seq_len`` a multiple of ``lcm(2 * cp, cp * tp)`` (pack with ``--tensor-model-parallel-size TP
    --sequence-parallel``). Ignored with a warning at TP = 1, as Megatron-LM does."""
    backend: str | None = field(default=None, metadata=rules(one_of(("nccl", "gloo"))))
    """``nccl`` or ``gloo``; default NCCL with CUDA, gloo on CPU."""

    @property
    def sequence_parallel_size(self) -> int:
        """The TP size when sequence parallelism is on, else 1."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("parallel", self)
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size == 1:
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1, "
                             f"got {self.virtual_pipeline_model_parallel_size} with 1")


@dataclass
class TrainConfig:
    """The step loop: batch size, length, seed, precision."""

    global_batch_size: int = field(default=8, metadata=rules(*POSITIVE))
    """Packed rows per optimizer step over all data-parallel ranks (= micro-batches x data-parallel size)."""
    train_steps: int = field(default=MISSING, metadata=rules(*POSITIVE))
    """Optimizer steps of the whole run (defines the LR schedule)."""
    stop_at_step: int | None = field(default=None, metadata=rules(*POSITIVE))
    """Stop (after checkpointing) once this step is done, before ``train_steps``; the schedule is unchanged.
    For time-limited jobs: resume later with ``checkpoint.resume=auto``."""
    seed: int = field(default=1234, metadata=rules(SEED))
    """Seeds weight init (``torch.manual_seed``) and ``random``, plus 100 x the pipeline rank (as Megatron-LM); the
    data order uses ``loader.seed``."""
    autocast_dtype: str | None = field(default=None, metadata=rules(one_of(AUTOCAST_DTYPES)))
    """``bfloat16``/``float16``: ``torch.autocast`` on CUDA with fp32 master weights; null = no autocast (fp32).
    CPU autocast is refused (Megatron's backward fails in ``LinearWithGradAccumulationAndAsyncCommunication``)."""
    bf16: bool = False
    """Megatron mixed precision: bf16 parameters and activations (``Float16Module``), fp32 gradient accumulation
    and reduction (``main_grad``), fp32 master weights in the optimizer. Exclusive with ``autocast_dtype``. Runs on
    CPU too."""
    compile: bool = False
    """``torch.compile`` each transformer layer (``packsft.model.compile``; the core attention stays eager). The first
    steps pay the compile time (about a minute per distinct layer graph); off by default."""

    max_skipped_steps: int = field(default=10, metadata=rules(*NON_NEGATIVE))
    """Steps in a row whose loss or gradient norm is not finite that are skipped (no update, counted in
    ``skipped_steps``) before the run stops with an error; 0 stops at the first."""
    save_on_sigterm: bool = True
    """On SIGTERM (what Slurm and torchrun send before killing) or SIGINT (Ctrl-C) finish the current step, write a
    checkpoint and exit 0; false leaves the signals' defaults (the process ends at once, no checkpoint)."""

    relations: ClassVar = (
        at_most("stop_at_step", "train_steps"),
        Exclusive("bf16", "autocast_dtype"),
    )

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("train", self)


@dataclass
class CheckpointConfig:
    """Megatron ``dist_checkpointing`` checkpoints (layout in ``packsft.train.checkpoint``)."""

    dir: str | None = None
    """Checkpoint folder; default ``<logging.output_dir>/checkpoints``."""
    save_interval: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Save every N steps; 0 = only at the end."""
    save_at_end: bool = True
    """Save after step ``train_steps``. A stop at ``train.stop_at_step`` always saves (it exists to resume later,
    as Megatron-LM's ``--exit-interval`` saves)."""
    resume: str = "auto"
    """``auto`` (the ``latest`` checkpoint in ``dir`` if any), ``none``, or a path to an ``iter_XXXXXXX`` folder."""
    restore_data_order: bool = True
    """Restore the loader's position in the data order (the same data; any data-parallel size); false restarts the
    data order from its first rows, those already trained included (a ``note:`` says so; use it to resume with
    another context-parallel file)."""
    init_from: str | None = None
    """Model-only checkpoint folder (``tools/convert_checkpoint.py import --out``) whose weights start the run when
    there is nothing to resume (a checkpoint found by ``resume`` wins); optimizer, schedule and data order start
    fresh. Its ``model_config.json`` fills the ``model`` section; ``model`` keys set in the YAML or overrides must
    agree with it, except those ``packsft.train.compat.MAY_CHANGE["init_from"]`` names."""
    keep_last: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Keep only the N newest complete checkpoints (by step; never the one ``latest`` names); 0 keeps all."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a negative ``save_interval`` or ``keep_last``."""
        check_fields("checkpoint", self)


@dataclass
class LoggingConfig:
    """Outputs of the run: progress bar, ``metrics.jsonl``, TensorBoard events."""

    output_dir: str = "out/train"
    """Run folder: ``metrics.jsonl``, ``tensorboard/``, ``config.yaml``, ``checkpoints/`` (by default)."""
    log_interval: int = field(default=1, metadata=rules(*POSITIVE))
    """Write a metrics record every N steps."""
    tensorboard: bool = True
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``log_interval``."""
        check_fields("logging", self)


@dataclass
class ValidationConfig:
    """Validation passes over ``data.validation_path``, the ``data.split_validation_size`` held-out rows, or (Energon)
    ``data.energon.validation_split``."""

    val_period: int = field(default=0, metadata=rules(*NON_NEGATIVE))
    """Validate every N steps; 0 = never periodically."""
    val_at_start: bool = False
    val_at_end: bool = False
    max_batches: int | None = field(default=None, metadata=rules(*POSITIVE))
    """Micro-batches per data-parallel rank and pass; null = the whole validation set."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("validation", self)

    @property
    def enabled(self) -> bool:
        """True when any validation pass is requested."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end



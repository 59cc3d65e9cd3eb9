"""The sections of the training configuration (``data``, ``loss``, ``scheduler``, ``parallel``, ``train``,
``checkpoint``, ``logging``, ``validation``): dataclasses whose ``__post_init__`` checks their own fields and raises
``ValueError`` naming the dotted key and the value. :mod:`packsft.train.config` assembles them (with ``model``,
``loader``, ``optimizer`` and ``lora``) into :class:`~packsft.train.config.Config` and loads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

DECAY_STYLES = ("cosine", "linear", "constant")
VERIFY_HASH = ("auto", "full")
AUTOCAST_DTYPES = ("bfloat16", "float16")


def check_positive(section: str, obj, *names: str, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` naming ``section.name`` for each field that is not a finite number > 0 (or >= 0).

    ``None`` and OmegaConf's ``MISSING`` (a schema default still to be filled by the YAML) are skipped.
    """
    for name in names:
        value = getattr(obj, name)
        if value is None or value == MISSING:
            continue
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
            raise ValueError(f"{section}.{name} must be a finite number, got {value!r}")
        if (value < 0) if allow_zero else (value <= 0):
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{section}.{name} must be {bound}, got {value!r}")


@dataclass
class TrainSourceConfig:
    """One packed training file of ``data.train`` (a mixture when there are several)."""

    path: str = MISSING
    """The ``.jsonl.packed`` file (with its sidecar)."""
    name: str | None = None
    """Name in logs, checkpoints and errors; default: the file name without ``.jsonl.packed``."""
    weight: float = 1.0
    """Share of the training rows drawn from this source, normalised over the sources (``[7, 3]`` is ``[0.7, 0.3]``)."""
    split_validation_size: float = 0.0
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


@dataclass
class DataConfig:
    """Packed input files and how to tokenize them (must match the packer's settings, checked via the sidecar)."""

    train: list[TrainSourceConfig] = field(default_factory=list)
    """Training sources ``[{name, path, weight, split_validation_size}]``; several make a weighted mixture."""
    train_path: str | None = None
    """A single training file: the same as ``train: [{path: ...}]``."""
    tokenizer: str = MISSING
    """Local tokenizer folder or ``tokenizer.json`` (the one the file was packed with)."""
    max_seq_len: int = MISSING
    """Tokens per packed row ``L``; a multiple of ``2 * parallel.context_parallel_size`` when CP > 1."""
    prompt_format: str = "chat-template"
    """``chat-template``, ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned`` or ``passthrough``."""
    chat_template: str | None = None
    """Jinja string or file for ``chat-template`` (default: the tokenizer's)."""
    pad_token: str | None = None
    """Pad token override, as given to the packer."""
    require_sidecar: bool = False
    """Refuse a packed file without ``<file>.meta.json`` instead of warning."""
    verify_hash: str = "auto"
    """How the packed files (rows, token cache) are checked against their sidecar at start: ``auto`` hashes a file
    of at most 256 MiB whole and checks a larger one only by size (a token cache file also by the BLAKE2b of its
    first and last MiB); ``full`` hashes every file whole (about 1 GB/s)."""
    validation: list[ValidationSourceConfig] = field(default_factory=list)
    """Named validation files ``[{name, path}]``, each evaluated and logged on its own."""
    validation_path: str | None = None
    """A single validation file: the same as ``validation: [{name: validation, path: ...}]``."""
    split_validation_size: float = 0.0
    """With ``train_path``: fraction in [0, 1) of its rows held out for validation (seeded by ``loader.seed``)."""
    samples_per_epoch: int | None = None
    """Rows per epoch of a mixture (default: all rows of all sources); each source gets its weight's share."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_positive("data", self, "max_seq_len", "samples_per_epoch")
        if self.verify_hash not in VERIFY_HASH:
            raise ValueError(f"data.verify_hash must be one of {VERIFY_HASH}, got {self.verify_hash!r}")
        if self.samples_per_epoch is not None and (self.train_path or len(self.train) == 1):  # it was ignored
            raise ValueError(f"data.samples_per_epoch ({self.samples_per_epoch}) sets the epoch of a mixture of "
                             "several data.train sources; with one source an epoch is all its rows")
        if not 0.0 <= self.split_validation_size < 1.0:
            raise ValueError(f"data.split_validation_size must be in [0, 1), got {self.split_validation_size!r}")
        if self.validation_path and self.split_validation_size > 0:
            raise ValueError("set either data.validation_path or data.split_validation_size, not both "
                             f"(got {self.validation_path!r} and {self.split_validation_size})")
        if self.train and self.train_path:
            raise ValueError("set either data.train (a list of {name, path, weight}) or data.train_path, not both")
        if self.train and self.split_validation_size > 0:
            raise ValueError("data.split_validation_size goes with data.train_path; with data.train give each "
                             "source its own split_validation_size")
        if self.validation and self.validation_path:
            raise ValueError("set either data.validation (a list of {name, path}) or data.validation_path, not both")
        for i, source in enumerate(self.train):
            if not source.weight > 0:
                raise ValueError(f"data.train[{i}].weight must be > 0, got {source.weight!r}")
            if not 0.0 <= source.split_validation_size < 1.0:
                raise ValueError(f"data.train[{i}].split_validation_size must be in [0, 1), got "
                                 f"{source.split_validation_size!r}")
        for kind, names in (("data.train", [n for n, *_ in self.train_sources()]),   # not validation_sources(),
                            ("data.validation", [_source_name(v.name, v.path) for v in self.validation])):  # a dict
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"{kind}: names must be unique, {dupes} appear twice (set name: per entry)")

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
        """True when a validation file or a held-out split is configured."""
        return bool(self.validation_sources()) or any(split > 0 for *_, split in self.train_sources())


@dataclass
class LossConfig:
    """Token cross-entropy, normalised by the trained tokens of the whole global batch (``docs/loss.md``)."""

    fused_linear_cross_entropy: bool = True
    """True: packsft's chunked fused linear-CE (never holds ``[t, v]`` logits); False: Megatron's stock
    ``vocab_parallel_cross_entropy`` on full logits."""
    chunk_size: int = 1024
    """Tokens per chunk of the fused loss; with vocabulary blocks of ``b = min(32768, vocab / tp)`` rows, its
    buffers are about ``chunk_size * b * (4 + 2e)`` bytes (``e`` = 2 for bf16 inputs, 0 for fp32; ``docs/loss.md``)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``chunk_size``."""
        check_positive("loss", self, "chunk_size")


@dataclass
class SchedulerConfig:
    """Learning rate per optimizer step: linear warmup from 0, then decay to ``min_lr``."""

    warmup_steps: int = 0
    """Steps of linear warmup (lr = lr * (step + 1) / warmup_steps)."""
    decay_style: str = "cosine"
    """``cosine``, ``linear`` or ``constant``."""
    decay_steps: int | None = None
    """Steps of decay after warmup; default ``train.train_steps - warmup_steps``. After it lr stays ``min_lr``."""
    min_lr: float = 0.0
    """Final learning rate."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_positive("scheduler", self, "warmup_steps", "min_lr", allow_zero=True)
        check_positive("scheduler", self, "decay_steps")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"scheduler.decay_style must be one of {DECAY_STYLES}, got {self.decay_style!r}")


@dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is ``WORLD_SIZE / (tensor * context * pipeline)``."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    """Pipeline stages ``P``: the layers are split over ``P`` ranks and each step runs Megatron-Core's 1F1B schedule
    (``get_forward_backward_func``) over the micro-batches; needs ``model.num_layers`` a multiple of ``P`` (times the
    virtual stages)."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (Megatron's interleaved 1F1B schedule); null: not interleaved. Needs ``P > 1``
    and micro-batches per step a multiple of ``P``."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (norms and residual stream split over the TP group); needs TP > 1 and
    ``data.max_seq_len`` a multiple of ``lcm(2 * cp, cp * tp)`` (pack with ``--tensor-model-parallel-size TP
    --sequence-parallel``). Ignored with a warning at TP = 1, as Megatron-LM does."""
    backend: str | None = None
    """``nccl`` or ``gloo``; default NCCL with CUDA, gloo on CPU."""

    @property
    def sequence_parallel_size(self) -> int:
        """The TP size when sequence parallelism is on, else 1."""
        return self.tensor_model_parallel_size if self.sequence_parallel else 1

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_positive("parallel", self, "tensor_model_parallel_size", "context_parallel_size",
                  "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size == 1:
            raise ValueError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1, "
                             f"got {self.virtual_pipeline_model_parallel_size} with 1")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"parallel.backend must be 'nccl', 'gloo' or null, got {self.backend!r}")


@dataclass
class TrainConfig:
    """The step loop: batch size, length, seed, precision."""

    global_batch_size: int = 8
    """Packed rows per optimizer step over all data-parallel ranks (= micro-batches x data-parallel size)."""
    train_steps: int = MISSING
    """Optimizer steps of the whole run (defines the LR schedule)."""
    stop_at_step: int | None = None
    """Stop (after checkpointing) once this step is done, before ``train_steps``; the schedule is unchanged.
    For time-limited jobs: resume later with ``checkpoint.resume=auto``."""
    seed: int = 1234
    """Seeds weight init (``torch.manual_seed``) and ``random``, plus 100 x the pipeline rank (as Megatron-LM); the
    data order uses ``loader.seed``."""
    autocast_dtype: str | None = None
    """``bfloat16``/``float16``: ``torch.autocast`` on CUDA with fp32 master weights; null = no autocast (fp32).
    CPU autocast is refused (Megatron's backward fails in ``LinearWithGradAccumulationAndAsyncCommunication``)."""
    bf16: bool = False
    """Megatron mixed precision: bf16 parameters and activations (``Float16Module``), fp32 gradient accumulation
    and reduction (``main_grad``), fp32 master weights in the optimizer. Exclusive with ``autocast_dtype``. Runs on
    CPU too."""
    compile: bool = False
    """``torch.compile`` each transformer layer (``packsft.model.compile``; the core attention stays eager). The first
    steps pay the compile time (about a minute per distinct layer graph); off by default."""

    max_skipped_steps: int = 10
    """Steps in a row whose loss or gradient norm is not finite that are skipped (no update, counted in
    ``skipped_steps``) before the run stops with an error; 0 stops at the first."""
    save_on_sigterm: bool = True
    """On SIGTERM (what Slurm and torchrun send before killing) or SIGINT (Ctrl-C) finish the current step, write a
    checkpoint and exit 0; false leaves the signals' defaults (the process ends at once, no checkpoint)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_positive("train", self, "global_batch_size", "train_steps", "stop_at_step")
        check_positive("train", self, "max_skipped_steps", allow_zero=True)
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile must be true or false, got {self.compile!r}")
        if not 0 <= self.seed < 2**63:  # torch.manual_seed overflows past 64 bits; negative seeds as loader.seed
            raise ValueError(f"train.seed must be in [0, 2**63), got {self.seed}")
        if self.autocast_dtype not in (None, *AUTOCAST_DTYPES):
            raise ValueError(f"train.autocast_dtype must be null or one of {AUTOCAST_DTYPES}, "
                             f"got {self.autocast_dtype!r}")


@dataclass
class CheckpointConfig:
    """Megatron ``dist_checkpointing`` checkpoints (layout in ``packsft.train.checkpoint``)."""

    dir: str | None = None
    """Checkpoint folder; default ``<logging.output_dir>/checkpoints``."""
    save_interval: int = 0
    """Save every N steps; 0 = only at the end."""
    save_at_end: bool = True
    """Save after step ``train_steps``. A stop at ``train.stop_at_step`` always saves (it exists to resume later,
    as Megatron-LM's ``--exit-interval`` saves)."""
    resume: str = "auto"
    """``auto`` (the ``latest`` checkpoint in ``dir`` if any), ``none``, or a path to an ``iter_XXXXXXX`` folder."""
    restore_data_order: bool = True
    """Restore the loader's sampler position (needs the same data-parallel size and data); false restarts the
    data order from its first rows, those already trained included (a ``note:`` says so; use it to resume with
    another data-parallel size or context-parallel file)."""
    init_from: str | None = None
    """Model-only checkpoint folder (``tools/convert_checkpoint.py import --out``) whose weights start the run when
    there is nothing to resume (a checkpoint found by ``resume`` wins); optimizer, schedule and data order start
    fresh. Its ``model_config.json`` fills the ``model`` section; ``model`` keys set in the YAML or overrides must
    agree with it, except those ``packsft.train.compat.MAY_CHANGE["init_from"]`` names."""
    keep_last: int = 0
    """Keep only the N newest complete checkpoints (by step; never the one ``latest`` names); 0 keeps all."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a negative ``save_interval`` or ``keep_last``."""
        check_positive("checkpoint", self, "save_interval", "keep_last", allow_zero=True)


@dataclass
class LoggingConfig:
    """Outputs of the run: progress bar, ``metrics.jsonl``, TensorBoard events."""

    output_dir: str = "out/train"
    """Run folder: ``metrics.jsonl``, ``tensorboard/``, ``config.yaml``, ``checkpoints/`` (by default)."""
    log_interval: int = 1
    """Write a metrics record every N steps."""
    tensorboard: bool = True
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` for a non-positive ``log_interval``."""
        check_positive("logging", self, "log_interval")


@dataclass
class ValidationConfig:
    """Validation passes over ``data.validation_path`` or the ``data.split_validation_size`` held-out rows."""

    val_period: int = 0
    """Validate every N steps; 0 = never periodically."""
    val_at_start: bool = False
    val_at_end: bool = False
    max_batches: int | None = None
    """Micro-batches per data-parallel rank and pass; null = the whole validation set."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_positive("validation", self, "val_period", allow_zero=True)
        check_positive("validation", self, "max_batches")

    @property
    def enabled(self) -> bool:
        """True when any validation pass is requested."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end



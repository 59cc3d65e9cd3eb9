"""Typed training configuration: dataclass schema + YAML file + dotted CLI overrides (OmegaConf).

``load_config("configs/tiny_cpu.yaml", ["optimizer.lr=1e-3", "train.train_steps=50"])`` merges, in order, the
schema defaults, the YAML file and the overrides, then builds the dataclasses with ``OmegaConf.to_object``, which
runs every section's ``__post_init__`` validation (``ModelConfig`` and ``DataLoaderConfig`` included) and finally the
cross-section checks of :class:`Config`. A misspelt key, a wrong type or an invalid value raises ``ValueError``
naming the dotted key and the value. Checks that need the world size (``global_batch_size`` vs data-parallel size)
are in :func:`check_parallel_layout`, called by the trainer after ``init_distributed``.

Resume and ``init_from`` compatibility (which keys may differ from a checkpoint's) is :mod:`packsft.train.compat`'s.

Sections (every field is documented in ``docs/training.md``): ``model`` (:class:`~packsft.model.config.ModelConfig`),
``data``, ``loader`` (:class:`~packsft.data.loader.DataLoaderConfig`), ``loss``, ``optimizer``, ``scheduler``,
``parallel``, ``train``, ``checkpoint``, ``logging``, ``validation``, ``lora``
(:class:`~packsft.model.lora.LoraConfig`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from packsft.data.loader import DataLoaderConfig
from packsft.io import missing_file, read_json_object
from packsft.layout import cp_granularity, row_granularity
from packsft.model.config import MODEL_CONFIG_FILE, ModelConfig
from packsft.model.lora import LoraConfig

DECAY_STYLES = ("cosine", "linear", "constant")
VERIFY_HASH = ("auto", "full")
AUTOCAST_DTYPES = ("bfloat16", "float16")
OPTIMIZER_BACKENDS = ("torch", "megatron")
RENAMED_KEYS = {
    "loader.dataloader_num_workers": "loader.num_workers",
    "loader.dataloader_persistent_workers": "loader.persistent_workers",
    "data.override_pad_token": "data.pad_token",
}
"""Old dotted keys still accepted (with a ``FutureWarning``) under their new names."""


def _positive(section: str, obj, *names: str, allow_zero: bool = False) -> None:
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
        _positive("data", self, "max_seq_len", "samples_per_epoch")
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
        _positive("loss", self, "chunk_size")


@dataclass
class OptimizerConfig:
    """AdamW with two parameter groups (decay / no decay) and global-norm clipping, from torch or Megatron-Core."""

    backend: str = "torch"
    """``torch``: ``torch.optim.AdamW`` replicated on every rank, torch ``DistributedDataParallel``. ``megatron``:
    Megatron-Core's ``DistributedDataParallel`` + ``get_megatron_optimizer`` (needed for
    ``use_distributed_optimizer`` and ``train.bf16``)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): fp32 master weights and Adam moments sharded over the
    data-parallel(-with-context-parallel) group; needs ``backend: megatron``."""
    lr: float = 3e-4
    """Peak learning rate (reached at the end of warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; 1-D parameters (norm weights, biases) get 0."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient L2 norm (TP-aware) to this value; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        if self.backend not in OPTIMIZER_BACKENDS:
            raise ValueError(f"optimizer.backend must be one of {OPTIMIZER_BACKENDS}, got {self.backend!r}")
        if self.use_distributed_optimizer and self.backend != "megatron":
            raise ValueError("optimizer.use_distributed_optimizer=true needs optimizer.backend=megatron, "
                             f"got {self.backend!r}")
        _positive("optimizer", self, "lr", "adam_eps")
        _positive("optimizer", self, "weight_decay", "clip_grad", allow_zero=True)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)!r}")


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
        _positive("scheduler", self, "warmup_steps", "min_lr", allow_zero=True)
        _positive("scheduler", self, "decay_steps")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"scheduler.decay_style must be one of {DECAY_STYLES}, got {self.decay_style!r}")


@dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is ``WORLD_SIZE / (tensor * context * pipeline)``."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    """Pipeline stages ``P``: the layers are split over ``P`` ranks and each step runs Megatron-Core's 1F1B schedule
    (``get_forward_backward_func``) over the micro-batches; needs ``optimizer.backend: megatron`` and
    ``model.num_layers`` a multiple of ``P`` (times the virtual stages)."""
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
        _positive("parallel", self, "tensor_model_parallel_size", "context_parallel_size",
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
    and reduction (``main_grad``), fp32 master weights in the optimizer. Needs ``optimizer.backend: megatron``;
    exclusive with ``autocast_dtype``. Runs on CPU too."""
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
        _positive("train", self, "global_batch_size", "train_steps", "stop_at_step")
        _positive("train", self, "max_skipped_steps", allow_zero=True)
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
        _positive("checkpoint", self, "save_interval", "keep_last", allow_zero=True)


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
        _positive("logging", self, "log_interval")


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
        _positive("validation", self, "val_period", allow_zero=True)
        _positive("validation", self, "max_batches")

    @property
    def enabled(self) -> bool:
        """True when any validation pass is requested."""
        return self.val_period > 0 or self.val_at_start or self.val_at_end


@dataclass
class Config:
    """The whole training configuration (see the module docstring)."""

    model: ModelConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    loader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        """Cross-section checks.

        Raises:
            ValueError: naming both dotted keys and values: ``data.max_seq_len`` not a multiple of
                ``2 * context_parallel_size``, ``max_seq_len`` above ``model.max_position_embeddings``, warmup
                longer than the run, validation without data, ``stop_at_step`` past ``train_steps``,
                ``scheduler.min_lr`` above ``optimizer.lr``.
        """
        cp, seq = self.parallel.context_parallel_size, self.data.max_seq_len
        if cp > 1 and seq % (2 * cp):
            raise ValueError(f"data.max_seq_len ({seq}) must be a multiple of 2 * parallel.context_parallel_size "
                             f"({2 * cp})")
        if self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size == 1:
            warnings.warn("parallel.sequence_parallel needs tensor_model_parallel_size > 1; it is ignored",
                          UserWarning, stacklevel=2)
            self.parallel.sequence_parallel = False
        granularity = row_granularity(cp, self.parallel.sequence_parallel_size)
        if seq % granularity:
            raise ValueError(f"data.max_seq_len ({seq}) must be a multiple of {granularity} with "
                             f"parallel.sequence_parallel: lcm(CP padding, CP x TP) = lcm({cp_granularity(cp)}, "
                             f"{cp} x {self.parallel.tensor_model_parallel_size}), the CP padding being 2 x CP when CP "
                             "> 1, else 1")
        if seq > self.model.max_position_embeddings:
            raise ValueError(f"data.max_seq_len ({seq}) must be <= model.max_position_embeddings "
                             f"({self.model.max_position_embeddings})")
        if self.scheduler.min_lr > self.optimizer.lr:
            raise ValueError(f"scheduler.min_lr ({self.scheduler.min_lr}) must be <= optimizer.lr "
                             f"({self.optimizer.lr}): the decay would raise the learning rate")
        if self.scheduler.warmup_steps > self.train.train_steps:
            raise ValueError(f"scheduler.warmup_steps ({self.scheduler.warmup_steps}) must be <= "
                             f"train.train_steps ({self.train.train_steps})")
        if self.train.bf16 and self.optimizer.backend != "megatron":
            raise ValueError(f"train.bf16=true needs optimizer.backend=megatron (fp32 master weights in Megatron's "
                             f"optimizer), got {self.optimizer.backend!r}")
        if self.train.bf16 and self.train.autocast_dtype is not None:
            raise ValueError(f"set either train.bf16 or train.autocast_dtype ({self.train.autocast_dtype!r}), not both")
        if self.train.stop_at_step is not None and self.train.stop_at_step > self.train.train_steps:
            raise ValueError(f"train.stop_at_step ({self.train.stop_at_step}) must be <= train.train_steps "
                             f"({self.train.train_steps})")
        pp, vp = self.parallel.pipeline_model_parallel_size, self.parallel.virtual_pipeline_model_parallel_size
        if pp > 1 and self.optimizer.backend != "megatron":
            raise ValueError(f"parallel.pipeline_model_parallel_size={pp} needs optimizer.backend=megatron (Megatron "
                             "DDP reduces the tied embedding over the first and last stage), got "
                             f"{self.optimizer.backend!r}")
        if self.model.num_layers % (pp * (vp or 1)):
            raise ValueError(f"model.num_layers ({self.model.num_layers}) must be a multiple of "
                             f"parallel.pipeline_model_parallel_size ({pp})"
                             + (f" x parallel.virtual_pipeline_model_parallel_size ({vp})" if vp else ""))
        if self.lora.enabled and self.model.attention_backend != "torch":
            raise ValueError(f"lora.enabled=true needs model.attention_backend=torch (Megatron's parallel linears), "
                             f"got {self.model.attention_backend!r}")
        if not self.data.train and not self.data.train_path:
            raise ValueError("data.train_path (one file) or data.train (a list of {name, path, weight}) is required")
        if self.validation.enabled and not self.data.has_validation:
            raise ValueError("validation is enabled (validation.val_period / val_at_start / val_at_end) but there is "
                             "no validation data: set data.validation, data.validation_path or a split_validation_size")

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<logging.output_dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.output_dir) / "checkpoints"


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                model_base: Callable[[str, Path, str], dict] | None = None) -> Config:
    """Build a :class:`Config` from a YAML file and dotted overrides (``section.key=value``).

    Args:
        path: YAML file, or None for schema defaults plus overrides only.
        overrides: e.g. ``["optimizer.lr=1e-3", "parallel.context_parallel_size=2"]``; applied after the file.
        model_base: ``(checkpoint.init_from, checkpoint dir, checkpoint.resume) -> model fields`` merged under the
            YAML when ``init_from`` is set; default: :func:`read_init_model_fields`.

    Returns:
        The validated :class:`Config` (plain dataclasses, not OmegaConf nodes).

    With ``checkpoint.init_from`` set, the checkpoint's ``model_config.json`` is merged under the YAML as the
    ``model`` section (so a YAML may omit ``model``). Whether the keys the YAML sets agree with it, and the model
    section a resumed checkpoint records when that folder is gone, are :mod:`packsft.train.compat`'s
    (:func:`~packsft.train.compat.load_train_config`, what a training run loads its config with).

    Raises:
        FileNotFoundError: ``path`` does not exist, or ``checkpoint.init_from`` has no ``model_config.json``.
        ValueError: an unknown key, a value of the wrong type, a missing required value (``???``) or any validation
            failure; the message names the file and the dotted key.
    """
    where = config_source(path, overrides)
    if path is not None and not Path(path).is_file():
        raise missing_file("config file", path)
    try:
        loose = [o for o in overrides if "=" not in o]
        if loose:
            raise ValueError(f"override {loose[0]!r} is not key=value (e.g. train.train_steps=100)")
        loaded = OmegaConf.load(path) if path else OmegaConf.create()
        if not isinstance(loaded, DictConfig):
            raise ValueError("the file must be a mapping of sections (model:, data:, train:, ...), not a list")
        layers = [_rename_old_keys(loaded, str(path)),
                  _rename_old_keys(OmegaConf.from_dotlist(list(overrides)), "the overrides")]
        merged = OmegaConf.merge(OmegaConf.structured(Config), *layers)
        init_from = merged.checkpoint.init_from
        if init_from:
            ckpt_dir = Path(merged.checkpoint.dir or Path(merged.logging.output_dir) / "checkpoints")  # checkpoint_dir
            base = (model_base(init_from, ckpt_dir, merged.checkpoint.resume) if model_base
                    else read_init_model_fields(init_from))
            merged = OmegaConf.merge(OmegaConf.structured(Config), {"model": base}, *layers)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise config_error(err, f"invalid config {where}") from err
    except ValueError as err:
        raise ValueError(f"invalid config {where}: {err}") from err
    except TypeError as err:  # OmegaConf.merge: a mapping where the schema has a list (data.train, data.validation)
        raise ValueError(f"invalid config {where}: {err} (a mapping where a list is expected: data.train and "
                         "data.validation are lists of entries, data.train=[{path: ..., weight: ...}, {...}]; an "
                         "override cannot set one item of a list, as data.train.1.weight=0 tries)") from err
    except yaml.YAMLError as err:  # the file is not YAML (its own message spans lines: one is kept)
        raise ValueError(f"invalid config {where}: not valid YAML: {' '.join(str(err).split())}") from err


def config_source(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """How error messages name a config: the file and the overrides (``<defaults>`` for neither)."""
    where = (str(path) if path else "") + (f" with overrides {list(overrides)}" if overrides else "")
    return where.strip() or "<defaults>"


def config_error(err: OmegaConfBaseException, where: str) -> ValueError:
    """OmegaConf's error (its message, then lines of full_key and types) as one line: ``where``, the key, the first
    line."""
    key = getattr(err, "full_key", None)
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    return ValueError(f"{where}: {f'{key}: ' if key else ''}{first}")


def _rename_old_keys(layer, where: str):
    """Move every :data:`RENAMED_KEYS` old key of one config layer to its new name, warning once per key.

    Raises:
        ValueError: both the old and the new name are set in the same layer.
    """
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(layer, old, default=MISSING)
        if value == MISSING:
            continue
        if OmegaConf.select(layer, new, default=MISSING) != MISSING:
            raise ValueError(f"{where} sets both {old} (the old name) and {new}; keep only {new}")
        section, key = old.split(".")
        del layer[section][key]
        OmegaConf.update(layer, new, value)
        warnings.warn(f"{where}: {old} is renamed {new}; the old name will be removed", FutureWarning, stacklevel=3)
    return layer




def read_init_model_fields(init_from: str | Path) -> dict:
    """The ``ModelConfig`` fields (a dict) of a checkpoint written by ``tools/convert_checkpoint.py import``.

    Raises:
        FileNotFoundError: ``<init_from>/model_config.json`` does not exist (not an imported checkpoint folder).
    """
    file = Path(init_from) / MODEL_CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint.init_from={str(init_from)!r}: {file} not found; point it at a folder "
                                "written by `tools/convert_checkpoint.py import --out DIR`")
    return read_json_object(file)






def config_to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (written to ``<output_dir>/config.yaml`` and into checkpoints)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def check_parallel_layout(cfg: Config, world_size: int) -> int:
    """Check the configuration against the job's world size and return the data-parallel size.

    ``world_size = TP x CP x PP x DP``.

    Raises:
        ValueError: ``world_size`` not a multiple of ``tp * cp * pp``, ``train.global_batch_size`` not a multiple
            of ``loader.micro_batch_size * data_parallel_size``, or (interleaved pipeline) micro-batches per step
            not a multiple of ``pp``; the message names the keys and values.
    """
    par = cfg.parallel
    tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    if world_size % (tp * cp * pp):
        raise ValueError(f"WORLD_SIZE ({world_size}) must be a multiple of parallel.tensor_model_parallel_size "
                         f"({tp}) * parallel.context_parallel_size ({cp}) * "
                         f"parallel.pipeline_model_parallel_size ({pp}) (world = TP x CP x PP x DP)")
    dp = world_size // (tp * cp * pp)
    per_step = cfg.loader.micro_batch_size * dp
    if cfg.train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
                         f"loader.micro_batch_size ({cfg.loader.micro_batch_size}) * data-parallel size ({dp})")
    micro_batches = cfg.train.global_batch_size // per_step
    if par.virtual_pipeline_model_parallel_size is not None and micro_batches % pp:
        raise ValueError(f"the interleaved pipeline schedule (parallel.virtual_pipeline_model_parallel_size="
                         f"{par.virtual_pipeline_model_parallel_size}) needs the micro-batches per step "
                         f"(train.global_batch_size {cfg.train.global_batch_size} / (loader.micro_batch_size "
                         f"{cfg.loader.micro_batch_size} x DP {dp}) = {micro_batches}) to be a multiple of "
                         f"parallel.pipeline_model_parallel_size ({pp})")
    return dp

"""Typed training configuration: dataclass schema + YAML file + dotted CLI overrides (OmegaConf).

``load_config("configs/tiny_cpu.yaml", ["optimizer.lr=1e-3", "train.train_steps=50"])`` merges, in order, the
schema defaults, the YAML file and the overrides, then builds the dataclasses with ``OmegaConf.to_object``, which
runs every section's ``__post_init__`` validation (``ModelConfig`` and ``DataLoaderConfig`` included) and finally the
cross-section checks of :class:`Config`. A misspelt key, a wrong type or an invalid value raises ``ValueError``
naming the dotted key and the value. Checks that need the world size (``global_batch_size`` vs data-parallel size)
are in :func:`check_parallel_layout`, called by the trainer before ``init_distributed``.

Resume and ``init_from`` compatibility (which keys may differ from a checkpoint's) is :mod:`packsft.train.compat`'s.

Sections (every field is documented in ``docs/training.md``; the dataclasses not named here are in
:mod:`packsft.train.config_sections`): ``model`` (:class:`~packsft.model.config.ModelConfig`),
``data``, ``loader`` (:class:`~packsft.data.loader.DataLoaderConfig`), ``loss``, ``optimizer``, ``scheduler``,
``parallel``, ``train``, ``checkpoint``, ``logging``, ``validation``, ``lora``
(:class:`~packsft.model.lora.LoraConfig`), ``vision`` (null, or a LLaVA model's vision side:
:class:`~packsft.train.config_vision.VisionSectionConfig`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from packsft.config_rules import (
    NON_NEGATIVE,
    POSITIVE,
    AnyOf,
    Needs,
    Rule,
    at_most,
    check_fields,
    config_errors,
    in_range,
    rules,
)
from packsft.data.loader import DataLoaderConfig
from packsft.io import missing_file, read_json_object
from packsft.layout import check_max_seq_len, data_parallel_size
from packsft.model.config import MODEL_CONFIG_FILE, VISION_CONFIG_FILE, ModelConfig
from packsft.model.lora import LoraConfig
from packsft.train.config_sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LossConfig,
    ParallelConfig,
    SchedulerConfig,
    TrainConfig,
    ValidationConfig,
    refuse_packed_loader_settings,
)
from packsft.train.config_vision import VISION_RELATIONS, VisionSectionConfig

RENAMED_KEYS = {
    "loader.dataloader_num_workers": "loader.num_workers",
    "loader.dataloader_persistent_workers": "loader.persistent_workers",
    "data.override_pad_token": "data.pad_token",
}
"""Old dotted keys still accepted (with a ``FutureWarning``) under their new names."""


@dataclass
class OptimizerConfig:
    """Megatron-Core's AdamW (decay for matrices, none for 1-D parameters) with global-norm clipping."""

    backend: str = field(default="megatron", metadata=rules(Rule(lambda v: v == "megatron", (
        "'megatron' (Megatron-Core's DDP and optimizer; the torch AdamW backend was removed)"))))
    """``megatron``, the one value: Megatron-Core's ``DistributedDataParallel`` + ``get_megatron_optimizer``, with
    torch's fused AdamW inside."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): fp32 master weights and Adam moments sharded over the
    data-parallel(-with-context-parallel) group."""
    lr: float = field(default=3e-4, metadata=rules(*POSITIVE))
    """Peak learning rate (reached at the end of warmup)."""
    weight_decay: float = field(default=0.1, metadata=rules(*NON_NEGATIVE))
    """Decoupled weight decay of matrices; 1-D parameters (norm weights, biases) get 0."""
    adam_beta1: float = field(default=0.9, metadata=rules(in_range(0, 1)))
    adam_beta2: float = field(default=0.95, metadata=rules(in_range(0, 1)))
    adam_eps: float = field(default=1e-8, metadata=rules(*POSITIVE))
    clip_grad: float = field(default=1.0, metadata=rules(*NON_NEGATIVE))
    """Clip the global gradient L2 norm (TP-aware) to this value; 0 disables clipping (the norm is still logged)."""

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field for invalid values."""
        check_fields("optimizer", self)


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
    vision: VisionSectionConfig | None = None

    relations: ClassVar = (
        at_most("data.max_seq_len", "model.max_position_embeddings"),
        at_most("scheduler.min_lr", "optimizer.lr", "the decay would raise the learning rate"),
        at_most("scheduler.warmup_steps", "train.train_steps"),
        Needs("lora.enabled", ("model.attention_backend", "torch"), "LoRA wraps Megatron's parallel linears"),
        AnyOf(("data.train_path", "data.train"), "one file, or a list of {name, path, weight}"),
        Needs("validation.enabled", "data.has_validation",
              "validation.val_period, val_at_start or val_at_end asks for validation passes, but there is no "
              "validation data: set data.validation, data.validation_path, a split_validation_size or (Energon) "
              "data.energon.validation_split"),
        Needs(("data.train", Rule(lambda train: len(train) > 1, "of several sources")), ("loader.sampler", "random"),
              "a mixture is sampled by its sources' weights (packsft.data.mixing.WeightedMixingSampler)"),
        *VISION_RELATIONS,
    )

    def __post_init__(self) -> None:
        """Cross-section checks: :attr:`relations`, then the row length and the pipeline split.

        Raises:
            ValueError: naming both dotted keys and values: ``data.max_seq_len`` not a multiple of
                :func:`~packsft.layout.row_granularity` or above ``model.max_position_embeddings``, warmup longer
                than the run, ``model.num_layers`` not a multiple of the pipeline stages, no training data,
                validation without data, ``scheduler.min_lr`` above ``optimizer.lr``, a mixture of several
                ``data.train`` sources with a ``loader.sampler`` other than ``random``.
        """
        if self.parallel.sequence_parallel and self.parallel.tensor_model_parallel_size == 1:
            warnings.warn("parallel.sequence_parallel needs tensor_model_parallel_size > 1; it is ignored",
                          UserWarning, stacklevel=2)
            self.parallel.sequence_parallel = False
        check_fields("", self)
        if self.data.backend == "energon":
            refuse_packed_loader_settings(self.loader)
        check_max_seq_len(self.data.max_seq_len, self.parallel.context_parallel_size,
                          self.parallel.sequence_parallel_size, name="data.max_seq_len", parallel="parallel.")
        self.model.check_parallel_fit(self.parallel.tensor_model_parallel_size,
                                      self.parallel.pipeline_model_parallel_size,
                                      self.parallel.virtual_pipeline_model_parallel_size, prefix="parallel.")

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<logging.output_dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else Path(self.logging.output_dir) / "checkpoints"


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), *,
                init_base: Callable[[str, Path, str], dict[str, dict]] | None = None) -> Config:
    """Build a :class:`Config` from a YAML file and dotted overrides (``section.key=value``).

    Args:
        path: YAML file, or None for schema defaults plus overrides only.
        overrides: e.g. ``["optimizer.lr=1e-3", "parallel.context_parallel_size=2"]``; applied after the file.
        init_base: ``(checkpoint.init_from, checkpoint dir, checkpoint.resume) -> {section: fields}`` (``model``,
            and ``vision`` for a LLaVA model) merged under the YAML when ``init_from`` is set; default:
            :func:`read_init_sections`.

    Returns:
        The validated :class:`Config` (plain dataclasses, not OmegaConf nodes).

    With ``checkpoint.init_from`` set, the checkpoint's ``model_config.json`` is merged under the YAML as the
    ``model`` section (so a YAML may omit ``model``), and an imported LLaVA model's ``vision_config.json`` as the
    ``vision`` section. Whether the keys the YAML sets agree with them, and the sections a resumed checkpoint
    records when that folder is gone, are :mod:`packsft.train.compat`'s
    (:func:`~packsft.train.compat.load_train_config`, what a training run loads its config with).

    Raises:
        FileNotFoundError: ``path`` does not exist, or ``checkpoint.init_from`` has no ``model_config.json``.
        ValueError: an unknown key, a value of the wrong type, a missing required value (``???``) or any validation
            failure; the message names the file and the dotted key.
    """
    where = f"invalid config {config_source(path, overrides)}"
    if path is not None and not Path(path).is_file():
        raise missing_file("config file", path)
    try:
        with config_errors(where, Config):
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
                ckpt_dir = Path(merged.checkpoint.dir or Path(merged.logging.output_dir) / "checkpoints")
                base = (init_base(init_from, ckpt_dir, merged.checkpoint.resume) if init_base
                        else read_init_sections(init_from))
                merged = OmegaConf.merge(OmegaConf.structured(Config), base, *layers)
            return OmegaConf.to_object(merged)
    except TypeError as err:  # OmegaConf.merge: a mapping where the schema has a list (data.train, data.validation)
        raise ValueError(f"{where}: {err} (a mapping where a list is expected: data.train and data.validation are "
                         "lists of entries, data.train=[{path: ..., weight: ...}, {...}]; an override cannot set one "
                         "item of a list, as data.train.1.weight=0 tries)") from err


def config_source(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """How error messages name a config: the file and the overrides (``<defaults>`` for neither)."""
    where = (str(path) if path else "") + (f" with overrides {list(overrides)}" if overrides else "")
    return where.strip() or "<defaults>"


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


def read_init_sections(init_from: str | Path) -> dict[str, dict]:
    """The config sections an imported checkpoint folder supplies: ``{"model": <model_config.json>}``, plus
    ``"vision": <vision_config.json>`` for a LLaVA model (``VisionSectionConfig`` fields, ``image_token_id`` set).

    Raises:
        FileNotFoundError: as :func:`read_init_model_fields`.
    """
    vision = Path(init_from) / VISION_CONFIG_FILE
    return {"model": read_init_model_fields(init_from), **({"vision": read_json_object(vision)} if vision.is_file()
                                                           else {})}






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
    dp = data_parallel_size(world_size, tp, cp, pp, parallel="parallel.")
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

"""Resume and ``init_from`` compatibility: which config keys may differ from what a checkpoint records.

:data:`MAY_CHANGE` is the one table; the checks read it. A run started from ``checkpoint.init_from`` (an imported
model folder) takes its ``model`` section from the folder's ``model_config.json`` (a LLaVA model's ``vision``
section from its ``vision_config.json``), and the keys the YAML sets must agree with them (:func:`check_init_model`,
:func:`check_init_vision`, called by :func:`load_train_config` after
:func:`~packsft.train.config.load_config`). A resumed (or exported) checkpoint records the config it was trained
with (``train_state.json``); the trainer compares the current sections with it before loading any tensor
(:func:`check_recorded_architecture`, :func:`check_recorded_optimizer`).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import yaml

from packsft.config_rules import build_config, config_errors
from packsft.io import read_json_object
from packsft.model.config import (
    MODEL_CONFIG_FILE,
    VISION_CONFIG_FILE,
    ModelConfig,
    config_from_dict,
    yaml_model_section,
)
from packsft.model.hf_config import full_attention_length
from packsft.model.lora import LoraConfig
from packsft.train.checkpoint_files import TRAIN_STATE, CheckpointError, find_resume_checkpoint, load_train_state
from packsft.train.config import (
    Config,
    OptimizerConfig,
    config_source,
    load_config,
    read_init_model_fields,
    read_init_sections,
)
from packsft.train.config_sections import ParallelConfig


class AllBut(NamedTuple):
    """Every key of a section may change except ``keys``."""

    keys: tuple[str, ...]


WEIGHTLESS_MODEL_KEYS = ("max_position_embeddings", "init_method_std", "recompute_granularity", "recompute_method",
                         "recompute_num_layers", "recompute_modules", "bias_activation_fusion")
"""``model`` keys no weight depends on."""

MAY_CHANGE: dict[str, dict[str, tuple[str, ...] | AllBut]] = {
    "init_from": {
        # a base imported in bf16 trains in fp32: the weights are cast on load
        "model": (*WEIGHTLESS_MODEL_KEYS, "params_dtype"),
        "vision": (),                           # a LLaVA model's vision side: every key shapes its weights
    },
    "resume": {     # and export: the weights, and the optimizer state, are those of the recorded config
        "model": WEIGHTLESS_MODEL_KEYS,
        "vision": (),
        "lora": ("dropout", "seed"),            # they shape no weight and no output
        "optimizer": AllBut(("backend", "use_distributed_optimizer")),   # the format of the optimizer state
        # with the distributed optimizer, whose state is sharded by them (its dp_reshardable format); else any
        "parallel": AllBut(("tensor_model_parallel_size", "pipeline_model_parallel_size")),
    },
}
"""Which keys of each config section may differ from what a checkpoint records, on ``init_from`` and on resume: a
tuple names the keys that may change (every other key the checkpoint records must agree), :class:`AllBut` the keys
that may not (every other may change). A section not named is not compared."""


def init_base(init_from: str | Path, checkpoint_dir: str | Path, resume: str) -> tuple[dict[str, dict], Path | None]:
    """The ``model`` (and a LLaVA model's ``vision``) sections a run with ``checkpoint.init_from`` starts from, and
    the resumed checkpoint they come from (None: ``<init_from>``'s ``model_config.json`` and ``vision_config.json``,
    :func:`~packsft.train.config.read_init_sections`). When ``model_config.json`` is gone and ``checkpoint.resume``
    finds a checkpoint in ``checkpoint_dir``: the sections that checkpoint records (the run no longer reads
    ``init_from``'s weights; a LoRA resume still needs them and says so).

    Raises:
        FileNotFoundError: ``model_config.json`` is missing and there is nothing to resume (naming the file), or
            the resume checkpoint is incomplete (:func:`~packsft.train.checkpoint_files.find_resume_checkpoint`).
        CheckpointError: the resume checkpoint records no model section.
    """
    if (Path(init_from) / MODEL_CONFIG_FILE).is_file():
        return read_init_sections(init_from), None
    path = find_resume_checkpoint(checkpoint_dir, resume)
    if path is None:
        read_init_model_fields(init_from)      # raises, naming the missing file
    recorded = recorded_architecture(load_train_state(path), path)
    return {"model": recorded["model"], **({"vision": recorded["vision"]} if recorded["vision"] else {})}, path


def load_train_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """:func:`~packsft.train.config.load_config` for a training run, with ``checkpoint.init_from`` checked.

    The ``model`` and ``vision`` sections come from :func:`init_base` (when the folder is gone and a checkpoint
    will be resumed, the sections it records, with a ``note:`` on stderr); the keys the YAML or the overrides set
    must agree with them (:func:`check_init_model`, :func:`check_init_vision`), and ``data.max_seq_len`` must fit
    the imported model's sliding window (:func:`check_init_window`).

    Raises:
        FileNotFoundError, ValueError: as ``load_config``; a ``model`` or ``vision`` key that differs from the
            checkpoint's, a ``vision`` section over a text model or ``vision: null`` over a LLaVA model, or rows
            longer than its window (``ValueError`` naming the file, the key and both values).
    """
    cfg = load_config(path, overrides, init_base=lambda *where: init_base(*where)[0])
    init_from = cfg.checkpoint.init_from
    if not init_from:
        return cfg
    imported, resumed = init_base(init_from, cfg.checkpoint_dir, cfg.checkpoint.resume)
    if resumed is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: checkpoint.init_from={str(init_from)!r} has no {MODEL_CONFIG_FILE}; the run resumes "
              f"{resumed}, whose recorded model section is used", file=sys.stderr)
    with config_errors(f"invalid config {config_source(path, overrides)}"):
        check_init_model(cfg, imported["model"],
                         None if resumed is None else f"the model section checkpoint {resumed} records")
        check_init_vision(cfg, imported.get("vision"),
                          None if resumed is None else f"the vision section checkpoint {resumed} records")
        check_init_window(cfg, init_from)
    return cfg


def _first_difference(current: dict, reference: dict, free: tuple[str, ...] = ()) -> str | None:
    """The first key of ``reference`` (not in ``free``) whose value ``current`` does not share, or None.

    Floats agree within a relative 1e-6 (an imported GGUF's ``norm_epsilon`` 1e-5 reads back as float32).
    """
    for key, value in reference.items():
        if key in free:
            continue
        if isinstance(value, float) and isinstance(current.get(key), float):
            same = math.isclose(current[key], value, rel_tol=1e-6)
        else:
            same = current.get(key) == value
        if not same:
            return key
    return None


def check_init_window(cfg: Config, init_from: str | Path) -> None:
    """Refuse a ``data.max_seq_len`` longer than the sliding window of the imported model (a Mistral, or a
    Qwen2/Qwen3 with windowed layers, whose ``sliding_window`` is below its ``max_position_embeddings``, read from
    ``<init_from>/hf_config.json``):
    packsft's full causal attention equals the model's only up to the window, whatever
    ``model.max_position_embeddings`` the config sets.

    Raises:
        ValueError: naming both lengths and the file.
    """
    file = Path(init_from) / "hf_config.json"       # written by tools/convert_checkpoint.py import
    if not file.is_file():
        return
    window = full_attention_length(read_json_object(file))
    if window is not None and cfg.data.max_seq_len > window:
        raise ValueError(f"data.max_seq_len ({cfg.data.max_seq_len}) is longer than the sliding_window ({window}) of "
                         f"the model checkpoint.init_from holds ({file}): packsft's full causal attention equals "
                         f"that model's only up to the window; set data.max_seq_len <= {window}")


def check_init_model(cfg: Config, imported: dict, source: str | None = None) -> None:
    """Refuse a ``model`` section that contradicts the ``checkpoint.init_from`` weights.

    ``source`` names where ``imported`` comes from (default: ``checkpoint.init_from``'s ``model_config.json``).

    Raises:
        ValueError: a ``model`` field (other than those ``MAY_CHANGE["init_from"]`` names)
            differs from ``imported``; the message names the field and both values.
    """
    check_model_fields(cfg.model, imported, source or f"checkpoint.init_from's {MODEL_CONFIG_FILE}")


def check_init_vision(cfg: Config, imported: dict | None, source: str | None = None) -> None:
    """Refuse a ``vision`` section that contradicts the ``checkpoint.init_from`` weights: ``imported`` (the
    folder's ``vision_config.json``, None for a text model) with ``vision: null``, a ``vision`` section over a text
    model, or a key that differs (``MAY_CHANGE["init_from"]["vision"]`` aside).

    Raises:
        ValueError: naming the key and both values, or the section.
    """
    source = source or f"checkpoint.init_from's {VISION_CONFIG_FILE}"
    if (cfg.vision is None) != (imported is None):
        raise ValueError(f"vision: checkpoint.init_from={cfg.checkpoint.init_from!r} holds a LLaVA model ({source}) "
                         "and the config sets vision: null; drop vision: null" if imported is not None else
                         f"vision: checkpoint.init_from={cfg.checkpoint.init_from!r} holds a text model (no "
                         f"{VISION_CONFIG_FILE}); import a LLaVA model or drop the vision: section")
    if imported is None:
        return
    if cfg.vision.image_token_id is None:        # null: the processor's, which the weights' then is (vlm_config)
        cfg.vision.image_token_id = imported.get("image_token_id")
    _refuse_init_difference("vision", asdict(cfg.vision), imported, source)


def check_model_fields(model: ModelConfig, imported: dict, source: str) -> None:
    """Refuse a ``model`` section that differs from a checkpoint's ``ModelConfig`` fields ``imported`` (read from
    ``source``, named in the message) in a key other than those ``MAY_CHANGE["init_from"]`` names.

    Raises:
        ValueError: naming the field and both values.
    """
    _refuse_init_difference("model", asdict(model), imported, source)


def _refuse_init_difference(section: str, current: dict, imported: dict, source: str) -> None:
    """Raise ``ValueError`` naming the first ``section`` key (``MAY_CHANGE["init_from"]`` aside) whose ``current``
    value differs from the checkpoint's ``imported`` one (read from ``source``), and both values."""
    key = _first_difference(current, imported, MAY_CHANGE["init_from"][section])
    if key is not None:
        raise ValueError(f"{section}.{key} ({current.get(key)!r}) differs from {source} ({imported[key]!r}): the "
                         f"weights have the latter; drop {section}.{key} from the config or set it to match")


def read_yaml_model(path: str | Path, base: dict | None, source: str | None = None, *,
                    check: bool = True) -> ModelConfig:
    """The ``ModelConfig`` of a training YAML's ``model:`` section merged over ``base`` (a checkpoint's
    ``ModelConfig`` fields, read from ``source``), as :func:`load_config` merges ``checkpoint.init_from``'s
    ``model_config.json`` under it: a partial section, or none, takes the rest from ``base``, and (``check``) a key
    that differs from ``base`` is refused (:func:`check_model_fields`). Without ``base``, the YAML's own
    ``checkpoint.init_from`` supplies it (:func:`read_init_model_fields`) when set.

    Raises:
        ValueError: naming the file: unknown fields, required fields with nothing to take them from, an invalid
            value, or (``check``) a key that differs from ``base``.
        FileNotFoundError: the YAML's ``checkpoint.init_from`` (read without ``base``) has no ``model_config.json``.
    """
    section = yaml_model_section(path)
    section = {} if section is None else section
    if base is None:
        checkpoint = (yaml.safe_load(Path(path).read_text()) or {}).get("checkpoint")
        init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
        if init_from:
            base, source = read_init_model_fields(init_from), str(Path(init_from) / MODEL_CONFIG_FILE)
    if base is None:
        return config_from_dict(ModelConfig, section, str(path), missing_hint=(
            ": a partial model section takes the rest from a checkpoint model config (model_config.json, "
            "train_state.json) or checkpoint.init_from, and there is none here; give every field"))
    model = build_config(ModelConfig, base, section, where=f"{path} model section over {source}")
    if check:
        check_model_fields(model, base, source or "the checkpoint's model config")
    return model


def recorded_architecture(train_state: dict, checkpoint: str | Path) -> dict[str, dict]:
    """The ``model``, ``lora``, ``optimizer``, ``train``, ``parallel``, ``loss`` and ``vision`` sections of the
    config a checkpoint was trained with (its ``train_state.json``).

    Returns:
        ``{"model": {...}, "lora": {...}, "optimizer": {...}, "train": {...}, "parallel": {...}, "loss": {...},
        "vision": {...}}`` (a section the run's config lacks or sets null: empty), plain YAML values.

    Raises:
        CheckpointError: ``train_state.json`` has no ``config`` with a ``model`` section.
    """
    text = train_state.get("config")
    try:
        recorded = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        recorded = None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("model"), dict):
        raise CheckpointError(f"{Path(checkpoint) / TRAIN_STATE} records no config with a model section (its "
                              "'config' is the run's YAML config as a string)")
    return {"model": recorded["model"], "lora": recorded.get("lora") or {},
            "optimizer": recorded.get("optimizer") or {}, "train": recorded.get("train") or {},
            "parallel": recorded.get("parallel") or {}, "loss": recorded.get("loss") or {},
            "vision": recorded.get("vision") or {}}


def _lora_fields(lora: dict) -> dict:
    """``lora`` fields as compared: ``target_modules`` as a sorted list (their order changes no weight)."""
    modules = lora.get("target_modules")
    return {**lora, "target_modules": sorted(modules)} if isinstance(modules, list) else lora


def check_recorded_architecture(model: ModelConfig, lora: LoraConfig | None, recorded: dict[str, dict],
                                checkpoint: str | Path, *, fix: str) -> None:
    """Refuse a ``model`` / ``lora`` section that differs from what a checkpoint was trained with.

    The ``model`` and ``lora`` keys ``MAY_CHANGE["resume"]`` names may differ (``lora`` keys are compared only when
    either side has LoRA on, and ``target_modules`` as a set); every other key the checkpoint records must agree (a
    changed ``rotary_base`` or ``lora.alpha`` would load cleanly and silently compute another function).

    Args:
        model, lora: the current sections (``lora`` None: LoRA off).
        recorded: :func:`recorded_architecture` of the checkpoint.
        checkpoint: the checkpoint folder, named in the message. fix: how to proceed, appended to the message
            (``{key}`` and ``{value}`` are replaced by the dotted key and the recorded value).

    Raises:
        CheckpointError: naming the first differing dotted key and both values.
    """
    current_lora = _lora_fields(asdict(lora)) if lora is not None else {"enabled": False}
    recorded_lora = _lora_fields(recorded["lora"]) if recorded["lora"].get("enabled") else {"enabled": False}
    _refuse_recorded_difference("model", asdict(model), recorded["model"], checkpoint, fix)
    _refuse_recorded_difference("lora", current_lora, recorded_lora, checkpoint, fix)


def _refuse_recorded_difference(section: str, current: dict, reference: dict, checkpoint: str | Path,
                                fix: str) -> None:
    """Raise :class:`CheckpointError` naming the first ``section`` key (``MAY_CHANGE["resume"]`` aside) whose
    ``current`` value differs from the one ``checkpoint`` records (``reference``), both values and ``fix``."""
    key = _first_difference(current, reference, MAY_CHANGE["resume"][section])
    if key is not None:
        how = fix.format(key=f"{section}.{key}", value="null" if reference[key] is None else reference[key])
        raise CheckpointError(f"{section}.{key} is {current.get(key)!r} but checkpoint {checkpoint} was trained "
                              f"with {reference[key]!r}; {how}")


def check_recorded_vision(vision, recorded: dict[str, dict], checkpoint: str | Path, *, fix: str) -> None:
    """Refuse a ``vision`` section (a LLaVA model's vision side; None: a text model) that differs from what a
    checkpoint was trained with: every key, ``MAY_CHANGE["resume"]["vision"]`` aside, and whether there is one.

    Args:
        recorded, checkpoint, fix: as :func:`check_recorded_architecture`'s.

    Raises:
        CheckpointError: naming the first differing ``vision.<key>`` and both values, or the section itself.
    """
    if vision is not None and vision.image_token_id is None:   # null: the processor's (vlm_config), the run's then
        vision.image_token_id = (recorded["vision"] or {}).get("image_token_id")
    current, reference = (asdict(vision) if vision is not None else {}), recorded["vision"]
    if bool(current) != bool(reference):
        now, then = ("a", "no") if current else ("no", "a")
        raise CheckpointError(f"the config has {now} vision: section but checkpoint {checkpoint} was trained with "
                              f"{then} vision model (an image-text model has one); a resumed run keeps the model it "
                              "was trained with")
    _refuse_recorded_difference("vision", current, reference, checkpoint, fix)


def check_recorded_optimizer(optimizer: OptimizerConfig, recorded: dict[str, dict], checkpoint: str | Path,
                             parallel: ParallelConfig | None = None) -> None:
    """Refuse a resume whose optimizer state format (``MAY_CHANGE["resume"]["optimizer"]``) differs from the
    checkpoint's (before: a ``KeyError`` traceback inside Megatron's ``load_state_dict``, or a silent conversion),
    or, with the distributed optimizer, whose ``MAY_CHANGE["resume"]["parallel"]`` differ (before:
    Megatron's ``Global shape mismatch`` of the optimizer shards).

    Raises:
        CheckpointError: naming the dotted key and both values.
    """
    new_run = ("start a new run from its weights (tools/convert_checkpoint.py export, import, then "
               "checkpoint.init_from)")
    rows = [("optimizer", key, getattr(optimizer, key), recorded["optimizer"][key], "its optimizer state has that "
             "format") for key in MAY_CHANGE["resume"]["optimizer"].keys if key in recorded["optimizer"]]
    if parallel is not None and optimizer.use_distributed_optimizer:
        rows += [("parallel", key, getattr(parallel, key), recorded.get("parallel", {}).get(key, 1),
                  "the distributed optimizer's state is sharded for it (only the data-parallel size may change)")
                 for key in MAY_CHANGE["resume"]["parallel"].keys]
    for section, key, now, was, why in rows:
        if now != was:
            fix = ("packsft no longer has that backend: " if key == "backend" else
                   f"resume with {section}.{key}={str(was).lower() if isinstance(was, bool) else was}, or ")
            raise CheckpointError(f"{section}.{key} is {now!r} but checkpoint {checkpoint} was trained with {was!r}, "
                                  f"and {why}; {fix}{new_run}")

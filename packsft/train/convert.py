"""Hugging Face <-> Megatron checkpoint conversion, the work of ``tools/convert_checkpoint.py`` (``import``: an HF
safetensors folder or GGUF file -> a model-only Megatron ``dist_checkpointing`` checkpoint; ``export``: a Megatron
checkpoint, a training run's included, -> an HF folder, LoRA merged or as a PEFT adapter). Every rank builds,
imports or exports its TP shard and pipeline stage; output folders are refused when they would replace an input or
hold foreign files, and are replaced as a whole once complete. Image-text models (LLaVA-1.5) take the same options
and checks here; their model side is :mod:`packsft.train.convert_llava`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from packsft.io import check_writable_dir, foreign_entries, read_json_object
from packsft.model.config import MODEL_CONFIG_FILE, VISION_CONFIG_FILE, ModelConfig, config_from_dict, read_model_config
from packsft.model.gpt import build_gpt_model
from packsft.model.hf_config import hf_config_from_model_config, model_config_from_hf
from packsft.model.hf_files import (
    HF_CONFIG_FILE,
    HF_EXPORT_FILES,
    check_hf_weight_files,
    load_hf_checkpoint,
    load_hf_config,
    read_hf_config,
    tokenizer_token_ids,
)
from packsft.model.hf_io import (
    PEFT_ADAPTER_FILES,
    load_hf_state_into_model,
    save_hf_checkpoint,
    save_peft_adapter,
    stage_hf_names,
)
from packsft.model.lora import LoraConfig, apply_lora, merge_lora, read_lora_config
from packsft.train.checkpoint_files import INIT_FROM, LORA_BASE, TRAIN_STATE, load_train_state
from packsft.train.compat import (
    check_model_fields,
    check_recorded_architecture,
    read_yaml_model,
    recorded_architecture,
)
from packsft.train.convert_llava import (
    default_processor,
    export_llava,
    import_llava,
    is_image_text,
    recorded_vision,
    resolve_image_token,
    vlm_config_from_fields,
)
from packsft.train.distributed import init_distributed
from packsft.train.model_checkpoint import (
    COMMON_FILE,
    FINGERPRINT_FILE,
    METADATA_FILE,
    check_lora_base,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
)


def export_sections(megatron: Path, config: str | None, saved: dict | None) -> tuple[ModelConfig, LoraConfig | None]:
    """The model and LoRA (None: off) sections to export ``megatron`` with.

    A training checkpoint (``saved``: its ``train_state.json``) records the config it was trained with: that is used
    when ``config`` is None, and ``config`` must agree with it otherwise. Other folders: ``config``, else the
    folder's ``model_config.json``. A YAML ``config``'s ``model:`` section may be partial or absent, as in training
    with ``checkpoint.init_from``: it is merged over the recorded section, else over the folder's
    ``model_config.json`` (which it must then agree with), else over its own ``checkpoint.init_from``'s
    (``packsft.train.compat.read_yaml_model``).

    Raises:
        ValueError: ``config`` differs from the recorded architecture or the folder's ``model_config.json`` (naming
            the key), unknown fields, or required fields with nothing to take them from.
    """
    is_yaml = config is not None and Path(config).suffix in (".yaml", ".yml")
    if saved is None:
        own = megatron / MODEL_CONFIG_FILE
        base = read_json_object(own) if own.is_file() else None
        if is_yaml:
            return read_yaml_model(config, base, str(own)), read_lora_config(config)
        model = read_model_config(config or megatron)
        if config is not None and base is not None:  # the folder's own: its weights have those (a silent mismatch)
            check_model_fields(model, base, str(own))
        return model, read_lora_config(config) if config else None
    recorded = recorded_architecture(saved, megatron)
    if config is None:
        model = config_from_dict(ModelConfig, recorded["model"], f"{megatron / TRAIN_STATE} model")
        lora = recorded["lora"]
        where = f"{megatron / TRAIN_STATE} lora"
        return model, (config_from_dict(LoraConfig, lora, where) if lora.get("enabled") else None)
    if is_yaml:     # checked against the recorded section below
        model = read_yaml_model(config, recorded["model"], f"{megatron / TRAIN_STATE} model", check=False)
        lora = read_lora_config(config)
    else:
        model = read_model_config(config)
        # a model_config.json has no lora section: the recorded one
        lora = config_from_dict(LoraConfig, recorded["lora"], f"{megatron / TRAIN_STATE} lora") \
            if recorded["lora"].get("enabled") else None
    check_recorded_architecture(model, lora, recorded, megatron,
                                fix="pass that run's config.yaml as --config, or leave --config out to use the "
                                    "recorded one")
    return model, lora


def recorded_init_from(saved: dict | None) -> Path | None:
    """The imported folder a training checkpoint's run started from (its ``init_from``), or None.

    ``train_state.json`` records it as an absolute path (older checkpoints: only the config's, maybe relative to the
    training folder). A recorded folder that no longer exists is named in a note on stderr.
    """
    import yaml

    if not saved:
        return None
    init_from = saved.get(INIT_FROM) or (
        (yaml.safe_load(saved.get("config") or "") or {}).get("checkpoint") or {}).get("init_from")
    if not init_from:
        return None
    if not Path(init_from).is_dir():
        print(f"note: the run started from {init_from}, which is not found here: config.json is built from the "
              "model config alone (pass --hf-config <original>/config.json to keep the original's fields)",
              file=sys.stderr)
        return None
    return Path(init_from)


def given_hf_config(path: str) -> dict:
    """The ``--hf-config`` given: a ``config.json``, or a folder holding ``hf_config.json`` (an imported checkpoint) or
    ``config.json`` (the original model).

    Raises:
        FileNotFoundError: ``path`` is neither (an explicit config is never silently replaced by a fresh one).
    """
    file = Path(path)
    if file.is_dir():
        file = next((file / n for n in (HF_CONFIG_FILE, "config.json") if (file / n).is_file()), file / "config.json")
    if not file.is_file():
        raise FileNotFoundError(f"--hf-config {path}: {file} not found (pass the original model's config.json, or a "
                                f"folder holding it or an imported checkpoint's {HF_CONFIG_FILE})")
    return read_hf_config(file)


def refuse_out_over_inputs(args: argparse.Namespace, **resolved: Path | None) -> None:
    """Refuse an output folder (``--out``, ``--lora-adapter``) that is a file, or is, or holds, an input or the
    other output.

    Each output is replaced as a whole when its new folder is complete, so such a folder would delete the input
    (e.g. ``import --hf DIR --out DIR`` replaced the original model by the Megatron checkpoint).

    Args:
        resolved: inputs found later, by what they are (the run's recorded LoRA base, its ``init_from``).

    Raises:
        ValueError: naming the output and the input it would replace.
    """
    inputs = {f"--{flag.replace('_', '-')}": getattr(args, flag) for flag in
              (("hf",) if args.command == "import" else ("megatron", "config", "hf_config", "tokenizer", "lora_base"))}
    outputs = {"--out": args.out}
    if args.command == "export" and args.lora_adapter:
        outputs["--lora-adapter"] = args.lora_adapter
    for name, out in outputs.items():
        if Path(out).exists() and not Path(out).is_dir():  # it would be replaced by a folder
            raise ValueError(f"{name} {out} is a file, not a folder: give a folder to write (it is replaced as a "
                             "whole)")
        out = Path(out).resolve()
        others = {**inputs, **resolved, **{k: v for k, v in outputs.items() if k != name}}
        for what, path in others.items():
            if path is not None and (out == Path(path).resolve() or out in Path(path).resolve().parents):
                raise ValueError(f"{name} {outputs[name]} would replace {what} {path} (the output folder is "
                                 "replaced as a whole): write to another folder")


IMPORT_FILES = (".metadata", "__*_*.distcp", COMMON_FILE, METADATA_FILE, MODEL_CONFIG_FILE, VISION_CONFIG_FILE,
                HF_CONFIG_FILE, FINGERPRINT_FILE)
"""The names (``fnmatch`` patterns) of the files ``import`` writes (``save_megatron_checkpoint``)."""


def refuse_foreign_out(args: argparse.Namespace) -> None:
    """Refuse an existing output folder (``--out``, ``--lora-adapter``) that holds anything but a previous output
    of the same kind (an import's, an export's, a PEFT adapter's files: ``IMPORT_FILES``, ``HF_EXPORT_FILES``,
    ``PEFT_ADAPTER_FILES``); an empty folder is fine. The new folder is written beside it and replaces it as a whole,
    so its other files (notes, a subfolder) would be deleted.

    Raises:
        ValueError: naming the output and the entries that are not an output's (subfolders with a trailing ``/``).
    """
    outputs = {"--out": (args.out, IMPORT_FILES, "import") if args.command == "import"
               else (args.out, HF_EXPORT_FILES, "export")}
    if args.command == "export" and args.lora_adapter:
        outputs["--lora-adapter"] = (args.lora_adapter, PEFT_ADAPTER_FILES, "PEFT adapter export")
    for flag, (out, patterns, what) in outputs.items():
        if not Path(out).is_dir():
            continue
        foreign = foreign_entries(out, patterns)
        if foreign:
            listed = ", ".join(foreign[:8]) + (f" ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
            raise ValueError(f"{flag} {out} holds files that are not a previous {what}: {listed}; the folder is "
                             "replaced as a whole: write to a new or empty folder, or move them out")


def run(args: argparse.Namespace) -> int:
    """``import`` or ``export`` as ``tools/convert_checkpoint.py`` parsed them; returns 0, errors propagate."""
    refuse_out_over_inputs(args)
    refuse_foreign_out(args)
    for flag, out in (("--out", args.out), ("--lora-adapter", getattr(args, "lora_adapter", None))):
        if out:                                           # the new folder is written beside the output
            check_writable_dir(Path(out).resolve().parent, f"{flag} {out}: its folder")
    pp = args.pipeline_model_parallel_size
    tp = args.tensor_model_parallel_size or max(1, int(os.environ.get("WORLD_SIZE", 1)) // pp)
    ctx = init_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if args.command == "import" and is_image_text(hf_config := load_hf_config(args.hf)):
        import_llava(args, ctx, hf_config)
    elif args.command == "import":
        cfg = model_config_from_hf(hf_config, max_seq_len=args.max_seq_len,
                                   attention_backend=args.attention_backend, params_dtype=args.params_dtype)
        cfg.check_parallel_fit(tp, pp)
        check_hf_weight_files(args.hf, cfg)      # headers only: a bad file is named before the model is built
        model = build_gpt_model(cfg)             # this rank's stage: its layers, embedding / head
        hf_config, hf_state = load_hf_checkpoint(args.hf, keep=stage_hf_names(model, cfg))
        load_hf_state_into_model(model, hf_state, cfg, ctx.tp_group)
        del hf_state
        save_megatron_checkpoint(model, cfg, args.out, hf_config=hf_config)
    else:
        megatron = Path(args.megatron)
        saved = load_train_state(megatron) if (megatron / TRAIN_STATE).is_file() else None
        recorded = saved.get(LORA_BASE) if saved is not None else None
        cfg, lora = export_sections(megatron, args.config, saved)
        sections = recorded_architecture(saved, megatron) if saved is not None else None
        vision, vision_source = recorded_vision(megatron, sections)
        if vision is not None:
            args.tokenizer = default_processor(args, saved)
        cfg.check_parallel_fit(tp, pp)
        # before the model is read: a tokenizer the model cannot embed is refused, its ids fill config.json
        token_ids = tokenizer_token_ids(args.tokenizer, cfg.vocab_size) if args.tokenizer else None
        if (args.merge_lora or args.lora_adapter) and lora is None:
            raise ValueError("--merge-lora / --lora-adapter need a LoRA run's checkpoint (or --config with "
                             "lora.enabled: true)")
        if lora is not None and not (args.merge_lora or args.lora_adapter):
            raise ValueError("the checkpoint holds LoRA adapters: pass --merge-lora or --lora-adapter DIR")
        if lora is not None and pp > 1:
            raise ValueError("LoRA export runs at --pipeline-model-parallel-size 1 (the checkpoint loads at any size)")
        if args.lora_base and recorded is None:  # it was ignored
            raise ValueError(f"--lora-base is for the checkpoint of a LoRA run started from an imported base (it "
                             f"holds only the adapters), and {megatron} is none (its {TRAIN_STATE} records no LoRA "
                             "base): leave --lora-base out")
        base_dir = check_lora_base(recorded, args.lora_base, megatron) if recorded is not None else None
        refuse_out_over_inputs(args, **{"the run's LoRA base": base_dir})
        hf_config = given_hf_config(args.hf_config) if args.hf_config else read_hf_config(megatron)
        origin = f"--hf-config {args.hf_config}" if args.hf_config else str(megatron / HF_CONFIG_FILE)
        if hf_config is None:       # the original HF config of the imported folder the run started from
            start = base_dir or recorded_init_from(saved)
            refuse_out_over_inputs(args, **{"the folder the run started from": start})
            hf_config = read_hf_config(start) if start is not None else None
            origin = str(start / HF_CONFIG_FILE) if hf_config is not None else "the model config"
        if vision is not None:
            vision = resolve_image_token(vision, args.tokenizer, hf_config, vision_source)
            if token_ids:   # where the original's text config lacks them (hf_config_from_model_config's rule)
                text = (hf_config or {}).get("text_config") or {}
                hf_config = {**(hf_config or {}), "text_config": {
                    **text, **{k: v for k, v in token_ids.items() if text.get(k) is None}}}
            export_llava(args, ctx, vlm_config_from_fields(cfg, vision, vision_source), hf_config, origin, megatron)
            if ctx.rank == 0:
                print(f"export: wrote {args.out}")
            return 0
        try:                # before any weight is read, on every rank (rank 0 alone builds it to write it)
            hf_config_from_model_config(cfg, base=hf_config, token_ids=token_ids)
        except ValueError as err:
            raise ValueError(f"{origin}: {err}") from None
        model = build_gpt_model(cfg)
        if lora is not None:
            apply_lora(model, lora)
        if base_dir is not None:            # adapters-only checkpoint: the base first, then the adapters
            load_megatron_checkpoint(model, base_dir, base_only=True)
            load_megatron_checkpoint(model, megatron, adapters_only=True)
        else:
            load_megatron_checkpoint(model, megatron)
        if args.merge_lora:
            merge_lora(model)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        save_hf_checkpoint(model, cfg, args.out, hf_config=hf_config, tokenizer_dir=args.tokenizer,
                           tp_group=ctx.tp_group, pp_group=ctx.pp_group, dtype=dtype, token_ids=token_ids)
        if args.lora_adapter:   # after its base: a failed base export leaves no new adapter beside an old base
            save_peft_adapter(model, cfg, lora, args.lora_adapter, base_model_name_or_path=args.out,
                              tp_group=ctx.tp_group, dtype=dtype)
    if ctx.rank == 0:
        print(f"{args.command}: wrote {args.out}")
    return 0

"""Hugging Face checkpoint files in and out of a (possibly TP-sharded) Megatron ``GPTModel``.

Read: a safetensors folder (``config.json`` and ``model.safetensors`` or the shards of
``model.safetensors.index.json``) or one GGUF file (transformers' dequantizing GGUF loader). Write:
``model.safetensors`` (sharded above ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and
the tokenizer files of ``TOKENIZER_FILES``, published atomically (``packsft.io.atomic_dir``). The tensor
mapping is :mod:`packsft.model.state_dict_adapter`, the config mapping :mod:`packsft.model.hf_config`.

Tensor parallelism: import shards (every rank reads the full HF state on CPU once, takes its slice and
frees the rest: peak host memory about one full fp32 copy of the model per process); export gathers
every rank's shard over the TP group (``all_gather``, so each TP rank briefly holds the full model)
and global rank 0 writes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from packsft.io import atomic_dir
from packsft.model.config import ModelConfig
from packsft.model.hf_config import hf_config_from_model_config
from packsft.model.state_dict_adapter import hf_to_megatron_state_dict, megatron_to_hf_state_dict
from packsft.process_groups import barrier, global_rank, rank_and_size

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
HF_CONFIG_FILE = "hf_config.json"
"""The source HF config kept in a Megatron checkpoint folder (see :func:`read_hf_config`)."""


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's, else ``model.safetensors``, else every one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / n for n in names]
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    return sorted(directory.glob("*.safetensors"))


def load_hf_checkpoint(path: str | Path) -> tuple[object, dict[str, Tensor]]:
    """Read a local HF causal-LM checkpoint: a safetensors directory or a GGUF file.

    Safetensors: ``config.json`` through ``AutoConfig`` and the tensors (as stored, usually bf16)
    through ``safetensors.torch.load_file``, honouring ``model.safetensors.index.json``. GGUF (a
    ``*.gguf`` path, or a directory holding one GGUF and no safetensors): transformers' GGUF loader
    (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``, needs the ``gguf``
    package), which dequantizes every tensor to fp32 and undoes llama.cpp's q/k permutation.

    Returns:
        ``(hf_config, state_dict)``: the transformers config and HF names -> full CPU tensors.

    Raises:
        FileNotFoundError: if ``path`` holds neither safetensors nor exactly one GGUF file.
    """
    from transformers import AutoConfig

    path = Path(path)
    gguf = path if path.suffix == ".gguf" and path.is_file() else None
    if gguf is None and path.is_dir() and not _safetensors_files(path):
        candidates = sorted(path.glob("*.gguf"))
        gguf = candidates[0] if len(candidates) == 1 else None
    if gguf is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        return model.config, {k: v.detach() for k, v in model.state_dict().items()}
    files = _safetensors_files(path) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and not exactly one *.gguf file")
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return AutoConfig.from_pretrained(str(path)), state


def _write_safetensors(state: dict[str, Tensor], directory: Path, max_shard_bytes: int) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index above ``max_shard_bytes``."""
    from safetensors.torch import save_file

    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t.contiguous()
        size += nbytes
    if len(groups) == 1:
        save_file(groups[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, directory / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_hf_checkpoint(hf_state: dict[str, Tensor], hf_config, out_dir: str | Path,
                        tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF checkpoint folder atomically (a temp folder beside ``out_dir``, then a rename).

    Files: ``model.safetensors`` (or shards + ``model.safetensors.index.json`` past ``max_shard_bytes``),
    ``config.json`` (``hf_config.save_pretrained``), ``generation_config.json``
    (``GenerationConfig.from_model_config``) and, from ``tokenizer_dir``, every file of
    ``TOKENIZER_FILES`` present there (tokenizer, its config with the embedded chat template, and
    ``chat_template.jinja``). Modes: the folder ``0777 & ~umask`` (0755), every file ``0666 & ~umask`` (0644),
    whatever the tokenizer files' own modes. A ``quantization_config`` (e.g. of a GGUF source) is dropped when no
    tensor is quantized (all floating point), so loaders do not try to dequantize plain weights.

    Raises:
        FileNotFoundError: if ``tokenizer_dir`` holds none of ``tokenizer.json``/``tokenizer.model``/``vocab.json``.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tok_files = []
    if tokenizer_dir is not None:
        tok_files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
        if not {f.name for f in tok_files} & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
            raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} has no tokenizer.json, tokenizer.model "
                                    "or vocab.json")
    if hasattr(hf_config, "quantization_config") and all(t.is_floating_point() for t in hf_state.values()):
        hf_config = copy.deepcopy(hf_config)
        del hf_config.quantization_config
    with atomic_dir(out_dir) as tmp:
        _write_safetensors(hf_state, tmp, max_shard_bytes)
        hf_config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(hf_config).save_pretrained(str(tmp))
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
    return out_dir


def load_hf_state_into_model(model, hf_state: dict[str, Tensor], cfg: ModelConfig, tp_group=None) -> None:
    """Copy a full HF state dict into this rank's ``GPTModel`` shard (cast to the model's dtypes).

    Args:
        model: ``GPTModel`` built by ``build_gpt_model(cfg)``.
        hf_state: full HF tensors (``load_hf_checkpoint``); each rank slices its own part.
        tp_group: the tensor-parallel process group (``None`` for TP=1).

    Raises:
        ValueError: naming Megatron parameters the conversion left unset or produced in excess.
    """
    tp_rank, tp_size = rank_and_size(tp_group)
    state = hf_to_megatron_state_dict(hf_state, cfg, tp_rank, tp_size)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"HF -> Megatron conversion mismatch: missing {missing}, unexpected "
                         f"{list(result.unexpected_keys)}")


def gather_model_shards(model, tp_group=None) -> list[dict[str, Tensor]]:
    """Every TP rank's Megatron state dict (``[r]`` = rank ``r``), on CPU, via ``all_gather`` over ``tp_group``.

    Collective over ``tp_group``; ``_extra_state`` entries are dropped. Memory: each TP rank holds the
    full model on CPU for the duration of the call.
    """
    import torch.distributed as dist

    local = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    _, tp_size = rank_and_size(tp_group)
    if tp_size == 1:
        return [{k: v.cpu() for k, v in local.items()}]
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp_size)]
    for name, t in local.items():
        parts = [torch.empty_like(t) for _ in range(tp_size)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        for r, part in enumerate(parts):
            shards[r][name] = part.cpu()
    return shards


def save_hf_checkpoint(model, cfg: ModelConfig, out_dir: str | Path, *, hf_config=None,
                       tokenizer_dir: str | Path | None = None, tp_group=None,
                       dtype: torch.dtype | None = None) -> Path | None:
    """Export a (possibly TP-sharded) ``GPTModel`` as an HF checkpoint folder; global rank 0 writes.

    Collective over ``tp_group`` (every TP rank must call it); see :func:`write_hf_checkpoint` for the
    files and :func:`packsft.model.hf_config.hf_config_from_model_config` for ``hf_config`` (the
    original HF config or None).

    Args:
        dtype: tensor dtype in the safetensors files (default: as the model holds them).

    Returns:
        ``out_dir`` on global rank 0, ``None`` elsewhere.
    """
    shards = gather_model_shards(model, tp_group)
    out = None
    if global_rank() == 0:
        hf_state = megatron_to_hf_state_dict(shards, cfg)
        if dtype is not None:
            hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
        config = hf_config_from_model_config(cfg, base=hf_config)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        out = write_hf_checkpoint(hf_state, config, out_dir, tokenizer_dir)
    barrier()
    return out


def read_hf_config(path: str | Path) -> dict | None:
    """An HF ``config.json`` as a dict: ``path`` itself, or a checkpoint folder's ``hf_config.json`` (else ``None``)."""
    path = Path(path)
    path = path / HF_CONFIG_FILE if path.is_dir() else path
    return json.loads(path.read_text()) if path.is_file() else None


PEFT_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def save_peft_adapter(model, cfg: ModelConfig, lora, out_dir: str | Path, *, base_model_name_or_path: str | None = None,
                      tp_group=None) -> Path | None:
    """Export a LoRA model's adapters as a PEFT folder: ``adapter_config.json``, ``adapter_model.safetensors``.

    Collective over ``tp_group``; global rank 0 writes (atomically). ``peft.PeftModel.from_pretrained(base, out_dir)``
    on the model :func:`save_hf_checkpoint` exports from the same (unmerged) weights gives the LoRA model's logits.

    Args:
        lora: the ``packsft.model.lora.LoraConfig`` the model was trained with (rank, alpha, targets; the config
            file names the HF linears of ``state_dict_adapter.LORA_HF_MODULES``).

    Returns:
        ``out_dir`` on global rank 0, ``None`` elsewhere.
    """
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    from packsft.model.state_dict_adapter import LORA_HF_MODULES, megatron_lora_to_peft_state_dict

    shards = gather_model_shards(model, tp_group)
    out = None
    if global_rank() == 0:
        state = megatron_lora_to_peft_state_dict(shards, cfg, lora.target_modules)
        targets = [name for t in lora.target_modules for name in LORA_HF_MODULES[t][1]]
        config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                target_modules=targets, bias="none", task_type="CAUSAL_LM",
                                base_model_name_or_path=base_model_name_or_path)
        with atomic_dir(Path(out_dir)) as tmp:
            save_file(state, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
            config.save_pretrained(str(tmp))
        out = Path(out_dir)
    barrier()
    return out

"""A (possibly TP- and PP-sharded) Megatron ``GPTModel`` from and to Hugging Face tensors.

The files are :mod:`packsft.model.hf_files` (read, checked, written), the tensor mapping
:mod:`packsft.model.state_dict_adapter`, the config mapping :mod:`packsft.model.hf_config`.

Tensor and pipeline parallelism: import shards (every rank reads its pipeline stage's HF tensors on CPU
once (``stage_hf_names``; GGUF: all of them), takes its TP slice and frees the rest: peak host memory about
one copy of the stage's HF tensors per process); export gathers every rank's shard over the TP group
(``all_gather``, so each TP rank briefly holds its stage's full tensors), then the stages' tensors over
the pipeline group to global rank 0, which writes.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor

from packsft.io import atomic_dir
from packsft.model.config import ModelConfig
from packsft.model.hf_config import hf_config_from_model_config
from packsft.model.hf_files import tokenizer_token_ids, write_hf_checkpoint
from packsft.model.state_dict_adapter import hf_to_megatron_state_dict, megatron_to_hf_state_dict
from packsft.process_groups import barrier, global_rank, rank_and_size


def stage_hf_names(model, cfg: ModelConfig):
    """Predicate on HF tensor names: those a pipeline stage ``model`` needs (:func:`load_hf_state_into_model`)."""
    layers, first, last = stage_parts(model)
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    names = set()
    if first or (last and cfg.tie_word_embeddings):
        names.add("model.embed_tokens.weight")
        if cfg.tie_word_embeddings:     # read only to check that it equals the embedding (load_hf_state_into_model)
            names.add("lm_head.weight")
    if last:
        names.update(["model.norm.weight"] if cfg.tie_word_embeddings else ["model.norm.weight", "lm_head.weight"])
    return lambda name: name in names or name.startswith(prefixes)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def stage_parts(model) -> tuple[list[int], bool, bool]:
    """A ``GPTModel`` pipeline stage's parts: ``(global 0-based layer numbers in local order, pre_process,
    post_process)``; ``(range(num_layers), True, True)`` without pipeline parallelism."""
    return ([layer.layer_number - 1 for layer in model.decoder.layers], bool(model.pre_process),
            bool(model.post_process))


def _renumber(state: dict[str, Tensor], numbers: dict[int, int]) -> dict[str, Tensor]:
    """``decoder.layers.<i>.`` -> ``decoder.layers.<numbers[i]>.`` in every key (other keys unchanged)."""
    def name(key: str) -> str:
        match = _LAYER.match(key)
        return key if match is None else f"decoder.layers.{numbers[int(match.group(1))]}." + key[match.end():]

    return {name(k): v for k, v in state.items()}


def load_hf_state_into_model(model, hf_state: dict[str, Tensor], cfg: ModelConfig, tp_group=None) -> None:
    """Copy a full HF state dict into this rank's ``GPTModel`` shard (cast to the model's dtypes).

    Pipeline parallelism: ``model`` is one stage (:func:`stage_parts`); it receives HF layer ``i`` for each of its
    layers of global number ``i``, the embedding when ``pre_process``, the final norm and output layer when
    ``post_process``; with tied embeddings a last stage without ``pre_process`` gets the embedding as its
    ``output_layer.weight`` (Megatron's duplicated copy of the first stage's).

    Args:
        model: ``GPTModel`` built by ``build_gpt_model(cfg)``.
        hf_state: full HF tensors (``load_hf_checkpoint``); each rank slices its own part.
        tp_group: the tensor-parallel process group (``None`` for TP=1).

    ``hf_state`` is trusted to hold every tensor the stage needs, floating point and in the shapes ``cfg`` implies:
    :func:`packsft.model.hf_files.check_hf_weight_files` checks a safetensors checkpoint's headers before the model is
    built, and transformers' GGUF loader builds its tensors from the config ``cfg`` is derived from.

    Raises:
        ValueError: a tied config whose ``lm_head.weight`` differs from the embedding (transformers keeps them apart).
    """
    tp_rank, tp_size = rank_and_size(tp_group)
    layers, first, last = stage_parts(model)
    tied_copy = last and not first and cfg.tie_word_embeddings
    head, embed = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        raise ValueError("the config ties the output layer to the embedding (tie_word_embeddings true), but the "
                         "checkpoint's lm_head.weight differs from model.embed_tokens.weight (transformers then "
                         "keeps them apart); set tie_word_embeddings to false in its config.json")
    state = hf_to_megatron_state_dict(hf_state, cfg, tp_rank, tp_size, layers=layers, embedding=first or tied_copy,
                                      head=last)
    state = _renumber(state, {g: j for j, g in enumerate(layers)})
    if tied_copy:
        state["output_layer.weight"] = state.pop("embedding.word_embeddings.weight")
    load_mapped_state(model, state)


def load_mapped_state(model, state: dict[str, Tensor]) -> None:
    """``model.load_state_dict(state)`` of a mapping's output (``state_dict_adapter``, ``hf_llava``): every key
    but megatron's ``_extra_state`` must be there and no other (else the mapping has a bug: an assertion), copied
    into the model's own dtypes; a shape that differs is torch's ``RuntimeError``."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)   # the mapping's


def _stage_state(model) -> dict[str, Tensor]:
    """This rank's tensors under global layer names; a last stage's tied copy of the embedding is left out."""
    layers, first, _ = stage_parts(model)
    local = {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, Tensor)
             and not k.endswith("._extra_state")}
    if model.share_embeddings_and_output_weights and not first:
        local.pop("output_layer.weight", None)
    return _renumber(local, dict(enumerate(layers)))


def _gather_stages(shards: list[dict[str, Tensor]], pp_group) -> list[dict[str, Tensor]] | None:
    """Merge every pipeline stage's TP shards onto pipeline rank 0 of the group holding global rank 0.

    Point-to-point, one tensor at a time (on the current CUDA device under NCCL, else CPU): stage ``s > 0`` sends
    its names/shapes/dtypes (``send_object_list``), then each tensor. Returns the merged shards on the receiving
    rank, ``None`` on every other rank (pipeline groups without global rank 0 do nothing).
    """
    import torch.distributed as dist

    pp_rank, pp_size = rank_and_size(pp_group)
    if pp_size == 1:
        return shards
    if 0 not in dist.get_process_group_ranks(pp_group):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" \
        else torch.device("cpu")
    dst = dist.get_global_rank(pp_group, 0)
    if pp_rank > 0:
        meta = [[(name, t.shape, t.dtype) for name, t in shard.items()] for shard in shards]
        dist.send_object_list([meta], dst=dst, group=pp_group, device=device)
        for shard in shards:
            for t in shard.values():
                dist.send(t.to(device).contiguous(), dst=dst, group=pp_group)
        return None
    merged = [dict(shard) for shard in shards]
    for stage in range(1, pp_size):
        src = dist.get_global_rank(pp_group, stage)
        box = [None]
        dist.recv_object_list(box, src=src, group=pp_group, device=device)
        for r, entries in enumerate(box[0]):
            for name, shape, dtype in entries:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src=src, group=pp_group)
                merged[r][name] = t.cpu()
    return merged


def gather_model_shards(model, tp_group=None, pp_group=None) -> list[dict[str, Tensor]] | None:
    """Every TP rank's Megatron state dict of the whole model (``[r]`` = TP rank ``r``), on CPU, global layer names.

    TP: ``all_gather`` over ``tp_group`` (collective; each TP rank holds its stage's full tensors). PP (``pp_group``
    of more than one stage): the stages' gathered tensors travel to pipeline rank 0 of the pipeline group holding
    global rank 0 (:func:`_gather_stages`), which returns the whole model; every other rank returns ``None``.
    ``_extra_state`` entries and a last stage's tied output weight are dropped. Collective over TP and PP.
    """
    import torch.distributed as dist

    local = _stage_state(model)
    _, tp_size = rank_and_size(tp_group)
    if tp_size == 1:
        shards = [{k: v.cpu() for k, v in local.items()}]
    else:
        shards = [{} for _ in range(tp_size)]
        for name, t in local.items():
            parts = [torch.empty_like(t) for _ in range(tp_size)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            for r, part in enumerate(parts):
                shards[r][name] = part.cpu()
    return _gather_stages(shards, pp_group)


def save_hf_checkpoint(model, cfg: ModelConfig, out_dir: str | Path, *, hf_config=None,
                       tokenizer_dir: str | Path | None = None, tp_group=None, pp_group=None,
                       dtype: torch.dtype | None = None, token_ids: dict | None = None) -> Path | None:
    """Export a (possibly TP- and PP-sharded) ``GPTModel`` as an HF checkpoint folder; global rank 0 writes.

    Collective over ``tp_group`` and ``pp_group`` (every rank must call it; :func:`gather_model_shards`); see
    :func:`write_hf_checkpoint` for the files and :func:`packsft.model.hf_config.hf_config_from_model_config` for
    ``hf_config`` (the original HF config or None). The files equal a PP=1, TP=1 export's.

    Args:
        dtype: tensor dtype in the safetensors files (default: as the model holds them).
        token_ids: bos/eos/pad ids written where ``hf_config`` lacks them (default: ``tokenizer_dir``'s,
            :func:`tokenizer_token_ids`, checked on every rank before any collective).

    Returns:
        ``out_dir`` on global rank 0, ``None`` elsewhere.

    Raises:
        ValueError: if the tokenizer has more tokens than ``cfg.vocab_size``.
    """
    if token_ids is None and tokenizer_dir is not None:
        token_ids = tokenizer_token_ids(tokenizer_dir, cfg.vocab_size)
    shards = gather_model_shards(model, tp_group, pp_group)
    out = None
    if global_rank() == 0:
        hf_state = megatron_to_hf_state_dict(shards, cfg)
        if dtype is not None:
            hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
        config = hf_config_from_model_config(cfg, base=hf_config, token_ids=token_ids)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        out = write_hf_checkpoint(hf_state, config, out_dir, tokenizer_dir)
    barrier()
    return out



PEFT_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def save_peft_adapter(model, cfg: ModelConfig, lora, out_dir: str | Path, *, base_model_name_or_path: str | None = None,
                      tp_group=None, dtype: torch.dtype | None = None) -> Path | None:
    """Export a LoRA model's adapters as a PEFT folder: ``adapter_config.json``, ``adapter_model.safetensors``.

    Collective over ``tp_group``; global rank 0 writes (atomically). ``peft.PeftModel.from_pretrained(base, out_dir)``
    on the model :func:`save_hf_checkpoint` exports from the same (unmerged) weights gives the LoRA model's logits.

    Args:
        lora: the ``packsft.model.lora.LoraConfig`` the model was trained with (rank, alpha, targets; the config
            file names the HF linears of ``state_dict_adapter.LORA_HF_MODULES``).
        dtype: tensor dtype in ``adapter_model.safetensors`` (default: as the model holds them), as
            :func:`save_hf_checkpoint`'s.

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
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
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

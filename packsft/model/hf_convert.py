"""Hugging Face checkpoints in and out of packsft's Megatron ``GPTModel`` (Llama, Qwen2, Mistral families).

Shape legend: ``h`` hidden size, ``np`` query heads, ``ng`` key/value groups, ``qpg = np // ng`` query
heads per group, ``hn`` head dimension, ``f`` SwiGLU width, ``v`` vocabulary, ``tp`` tensor-parallel size.

Tensor layouts (Megatron-Core 0.16.1 local spec, what :func:`packsft.model.gpt.build_gpt_model` builds)::

    HF (transformers LlamaForCausalLM & co.)          Megatron GPTModel, TP rank r of tp
    model.embed_tokens.weight        [v, h]           embedding.word_embeddings.weight      rows r*v/tp..
    model.layers.i.input_layernorm.weight   [h]       decoder.layers.i.input_layernorm.weight   (replicated)
    self_attn.q_proj/k_proj/v_proj   [np*hn|ng*hn, h] decoder.layers.i.self_attention.linear_qkv.weight
                                                          [ng/tp * (qpg + 2) * hn, h], per query group
                                                          [q_g (qpg*hn rows), k_g (hn), v_g (hn)], groups
                                                          r*ng/tp.. (Qwen2: .bias alike, [.. * hn])
    self_attn.o_proj.weight          [h, np*hn]       self_attention.linear_proj.weight  [h, np*hn/tp] (cols)
    post_attention_layernorm.weight  [h]              decoder.layers.i.pre_mlp_layernorm.weight (replicated)
    mlp.gate_proj / up_proj.weight   [f, h] each      mlp.linear_fc1.weight [2f/tp, h] = cat(gate_r, up_r)
    mlp.down_proj.weight             [h, f]           mlp.linear_fc2.weight  [h, f/tp] (cols)
    model.norm.weight                [h]              decoder.final_layernorm.weight (replicated)
    lm_head.weight                   [v, h]           output_layer.weight  rows r*v/tp.. (absent when tied)

With ``attention_backend="te"`` the two per-layer norms are fused into the linears and are named
``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``.
HF q/k weights are already in the "rotate half" RoPE layout that Megatron uses
(``rotary_interleaved=False``), so no permutation is needed. Sources: transformers
``modeling_llama.py`` / ``modeling_qwen2.py``; Megatron-Core ``transformer/attention.py``
(``get_query_key_value_tensors``) and ``transformer/mlp.py`` (``glu``: ``silu(x[:f]) * x[f:]``).

Tensor parallelism: import shards (every rank reads the full HF state on CPU once, takes its slice and
frees the rest: peak host memory about one full fp32 copy of the model per process); export gathers
every rank's shard over the TP group (``all_gather``, so each TP rank briefly holds the full model)
and global rank 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

import torch
from torch import Tensor

from packsft.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Megatron's fixed Llama-3.1 scaling constants (rotary_pos_embedding.py, RotaryEmbedding._apply_scaling).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
MODEL_CONFIG_FILE = "model_config.json"
HF_CONFIG_FILE = "hf_config.json"


# ----------------------------------------------------------------------------------------- configs
def _rope_parameters(hf_config) -> dict:
    """``rope_parameters`` (transformers 5) or the older ``rope_theta`` + ``rope_scaling`` pair, as one dict."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _rope_scaling_factor(hf_config) -> float | None:
    """Megatron ``rope_scaling_factor`` for the config's RoPE type, or ``None`` for plain RoPE.

    Raises:
        ValueError: for a RoPE type other than ``default`` / ``llama3``, or ``llama3`` with constants
            Megatron cannot express (it fixes low 1, high 4, original 8192).
    """
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] == "default":
        return None
    if rope["rope_type"] != "llama3":
        raise ValueError(f"unsupported rope_parameters.rope_type {rope['rope_type']!r}; packsft supports "
                         "'default' and 'llama3'")
    for key, expected in MEGATRON_LLAMA3_ROPE.items():
        if float(rope.get(key, expected)) != expected:
            raise ValueError(f"unsupported llama3 RoPE scaling: rope_parameters.{key} = {rope.get(key)!r}, "
                             f"Megatron-Core fixes it at {expected}")
    return float(rope["factor"])


def _refuse_unsupported(hf_config, max_seq_len: int | None) -> None:
    """Raise ``ValueError`` naming the first HF option packsft's Megatron model cannot reproduce."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; packsft's MLP is SwiGLU (silu)")
    for name in ("attention_bias", "mlp_bias"):   # Llama options; Qwen2's QKV bias is built in
        if getattr(hf_config, name, False):
            raise ValueError(f"unsupported {name}=True for model_type {model_type!r}")
    if getattr(hf_config, "pretraining_tp", 1) != 1:
        raise ValueError(f"unsupported pretraining_tp={hf_config.pretraining_tp}; expected 1")
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ValueError(f"unsupported attention_dropout={hf_config.attention_dropout}; packsft trains "
                         "without dropout, set it to 0.0")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("unsupported use_sliding_window=True; packsft attention is full causal")
    window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
    if window is not None and window < hf_config.max_position_embeddings:
        if max_seq_len is None or max_seq_len > window:
            raise ValueError(
                f"unsupported sliding_window={window} (< max_position_embeddings="
                f"{hf_config.max_position_embeddings}): packsft attention is full causal, which equals "
                f"Mistral's only when no conversation is longer than the window; pass max_seq_len <= {window} "
                f"(got {max_seq_len}) or set sliding_window to null")


def model_config_from_hf(hf_config, *, max_seq_len: int | None = None, attention_backend: str = "torch",
                         params_dtype: str = "float32") -> ModelConfig:
    """Translate a transformers ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig`` into a ``ModelConfig``.

    Args:
        hf_config: a transformers ``PretrainedConfig`` of a supported ``model_type``.
        max_seq_len: the longest row packsft will train on (tokens); only needed to accept a Mistral
            ``sliding_window`` smaller than ``max_position_embeddings`` (then it must be ``<= window``).
        attention_backend / params_dtype: as in ``ModelConfig``.

    Raises:
        ValueError: naming the option when the config uses something the Megatron model cannot
            reproduce: another ``model_type``, a ``hidden_act`` other than silu, ``attention_bias`` /
            ``mlp_bias`` on Llama, ``pretraining_tp`` > 1, ``attention_dropout`` > 0, a sliding window
            that can be reached, RoPE types other than default/llama3 (Megatron's constants).
    """
    _refuse_unsupported(hf_config, max_seq_len)
    head_dim = getattr(hf_config, "head_dim", None)
    default_head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        kv_channels=head_dim if head_dim and head_dim != default_head_dim else None,
        rotary_base=float(_rope_parameters(hf_config)["rope_theta"]),
        norm_epsilon=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        add_qkv_bias=hf_config.model_type == "qwen2",
        rope_scaling_factor=_rope_scaling_factor(hf_config),
        attention_backend=attention_backend,
        params_dtype=params_dtype,
    )


def hf_config_from_model_config(cfg: ModelConfig, base=None):
    """The transformers config that describes ``cfg``, for export.

    Args:
        cfg: the Megatron model's configuration.
        base: the original HF config (``PretrainedConfig`` or its ``to_dict()``) to keep model_type,
            token ids, sliding window and other metadata from; ``None`` builds a fresh ``Qwen2Config``
            when ``cfg.add_qkv_bias`` else a ``LlamaConfig``.

    Returns:
        ``PretrainedConfig`` with ``architectures`` set and the shape fields taken from ``cfg``.

    Raises:
        ValueError: if ``cfg.add_qkv_bias`` disagrees with the base's ``model_type`` (only Qwen2 has it).
    """
    from transformers import AutoConfig

    base = base.to_dict() if hasattr(base, "to_dict") else dict(base or {})
    model_type = base.get("model_type") or ("qwen2" if cfg.add_qkv_bias else "llama")
    if cfg.add_qkv_bias != (model_type == "qwen2"):
        raise ValueError(f"model.add_qkv_bias={cfg.add_qkv_bias} cannot be exported as model_type {model_type!r}")
    for key in ("model_type", "transformers_version", "architectures", "rope_scaling", "rope_theta"):
        base.pop(key, None)
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        rope = {**rope, "rope_type": "llama3", "factor": cfg.rope_scaling_factor, **MEGATRON_LLAMA3_ROPE}
    shape = dict(num_hidden_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                 intermediate_size=cfg.ffn_hidden_size, num_attention_heads=cfg.num_attention_heads,
                 num_key_value_heads=cfg.num_query_groups, vocab_size=cfg.vocab_size,
                 max_position_embeddings=cfg.max_position_embeddings, head_dim=cfg.head_dim,
                 rms_norm_eps=cfg.norm_epsilon, tie_word_embeddings=cfg.tie_word_embeddings,
                 rope_parameters=rope, hidden_act="silu", dtype=cfg.params_dtype)
    if cfg.kv_channels is None and "head_dim" not in base:
        del shape["head_dim"]   # Qwen2Config has no head_dim field; hidden_size // heads is the default
    hf_config = AutoConfig.for_model(model_type, **{**base, **shape})
    hf_config.architectures = [ARCHITECTURES[model_type]]
    return hf_config


# ---------------------------------------------------------------------------------- state dicts
def _norm_keys(cfg: ModelConfig, i: int) -> tuple[str, str]:
    """Megatron names of layer ``i``'s attention and MLP RMSNorm weights for ``cfg.attention_backend``."""
    p = f"decoder.layers.{i}."
    if cfg.attention_backend == "te":
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def _shard(t: Tensor, dim: int, tp_rank: int, tp_size: int) -> Tensor:
    """Slice ``tp_rank`` of ``tp_size`` equal parts along ``dim``, as a fresh contiguous tensor."""
    if t.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of a {tuple(t.shape)} tensor is not divisible by TP size {tp_size}")
    return t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig, tp_rank: int, tp_size: int) -> Tensor:
    """HF q ``[np*hn, *]``, k/v ``[ng*hn, *]`` -> Megatron ``[ng/tp * (qpg+2) * hn, *]`` (weight or bias)."""
    ng, hn = cfg.num_query_groups, cfg.head_dim
    qpg = cfg.num_attention_heads // ng
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, qpg * hn, *rest), k.reshape(ng, hn, *rest), v.reshape(ng, hn, *rest)], 1)
    return _shard(grouped, 0, tp_rank, tp_size).reshape(-1, *rest)


def _unpack_qkv(shards: Sequence[Tensor], cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`_pack_qkv` over all TP shards (in rank order): returns HF ``(q, k, v)``."""
    ng, hn = cfg.num_query_groups, cfg.head_dim
    qpg = cfg.num_attention_heads // ng
    full = torch.cat(list(shards), 0)
    rest = full.shape[1:]
    q, k, v = full.reshape(ng, (qpg + 2) * hn, *rest).split([qpg * hn, hn, hn], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron_state_dict(hf_state: dict[str, Tensor], cfg: ModelConfig, tp_rank: int = 0,
                              tp_size: int = 1) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s Megatron state dict from a full HF ``*ForCausalLM`` state dict (layouts above).

    Args:
        hf_state: HF names -> full tensors (any float dtype, kept). ``lm_head.weight`` is ignored when
            ``cfg.tie_word_embeddings``.
        cfg: the model configuration (``model_config_from_hf``).
        tp_rank / tp_size: this rank's tensor-parallel index and the TP size.

    Returns:
        Megatron parameter names -> fresh tensors of this rank's shard (no ``_extra_state`` entries).

    Raises:
        KeyError: naming a missing HF tensor.
        ValueError: if a sharded dimension is not divisible by ``tp_size``.
    """
    def get(name: str) -> Tensor:
        if name not in hf_state:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        return hf_state[name]

    out = {"embedding.word_embeddings.weight": _shard(get("model.embed_tokens.weight"), 0, tp_rank, tp_size),
           "decoder.final_layernorm.weight": get("model.norm.weight").clone()}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _shard(get("lm_head.weight"), 0, tp_rank, tp_size)
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_keys(cfg, i)
        out[attn_norm] = get(hf + "input_layernorm.weight").clone()
        out[mlp_norm] = get(hf + "post_attention_layernorm.weight").clone()
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            q, k, v = (get(f"{hf}self_attn.{n}_proj.{kind}") for n in "qkv")
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _pack_qkv(q, k, v, cfg, tp_rank, tp_size)
        out[mg + "self_attention.linear_proj.weight"] = _shard(get(hf + "self_attn.o_proj.weight"), 1, tp_rank,
                                                               tp_size)
        gate = _shard(get(hf + "mlp.gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(hf + "mlp.up_proj.weight"), 0, tp_rank, tp_size)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[mg + "mlp.linear_fc2.weight"] = _shard(get(hf + "mlp.down_proj.weight"), 1, tp_rank, tp_size)
    return out


def megatron_to_hf_state_dict(shards: Sequence[dict[str, Tensor]], cfg: ModelConfig) -> dict[str, Tensor]:
    """Full HF state dict from every TP rank's Megatron state dict (``shards[r]`` = rank ``r``; layouts above).

    ``_extra_state`` entries are ignored. With ``cfg.tie_word_embeddings`` no ``lm_head.weight`` is
    written (transformers ties it to ``model.embed_tokens.weight`` on load).

    Returns:
        HF names -> contiguous tensors in the shards' dtype.

    Raises:
        KeyError: naming a Megatron tensor missing from a shard.
    """
    def cat(name: str, dim: int) -> Tensor:
        missing = [r for r, s in enumerate(shards) if name not in s]
        if missing:
            raise KeyError(f"Megatron state of TP rank {missing[0]} has no tensor {name!r}")
        return torch.cat([s[name] for s in shards], dim).contiguous()

    first = shards[0]
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0),
           "model.norm.weight": first["decoder.final_layernorm.weight"].clone()}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_keys(cfg, i)
        out[hf + "input_layernorm.weight"] = first[attn_norm].clone()
        out[hf + "post_attention_layernorm.weight"] = first[mlp_norm].clone()
        for kind in ("weight", "bias") if cfg.add_qkv_bias else ("weight",):
            name = f"{mg}self_attention.linear_qkv.{kind}"
            cat(name, 0)  # presence check on every rank
            q, k, v = _unpack_qkv([s[name] for s in shards], cfg)
            for n, t in zip("qkv", (q, k, v)):
                out[f"{hf}self_attn.{n}_proj.{kind}"] = t.contiguous()
        out[hf + "self_attn.o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        cat(mg + "mlp.linear_fc1.weight", 0)
        gate_up = [s[mg + "mlp.linear_fc1.weight"].chunk(2, 0) for s in shards]
        out[hf + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up], 0).contiguous()
        out[hf + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up], 0).contiguous()
        out[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
    return out


# -------------------------------------------------------------------------------------- HF files
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


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished ``tmp`` folder to ``out_dir``; an existing ``out_dir`` is swapped out, then removed."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old)


def write_hf_checkpoint(hf_state: dict[str, Tensor], hf_config, out_dir: str | Path,
                        tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF checkpoint folder atomically (a temp folder beside ``out_dir``, then a rename).

    Files: ``model.safetensors`` (or shards + ``model.safetensors.index.json`` past ``max_shard_bytes``),
    ``config.json`` (``hf_config.save_pretrained``), ``generation_config.json``
    (``GenerationConfig.from_model_config``) and, from ``tokenizer_dir``, every file of
    ``TOKENIZER_FILES`` present there (tokenizer, its config with the embedded chat template, and
    ``chat_template.jinja``).

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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_safetensors(hf_state, tmp, max_shard_bytes)
        hf_config.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(hf_config).save_pretrained(str(tmp))
        for f in tok_files:
            shutil.copy2(f, tmp / f.name)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------------------- model-level import/export
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _tp_rank_size(tp_group) -> tuple[int, int]:
    import torch.distributed as dist

    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def load_hf_state_into_model(model, hf_state: dict[str, Tensor], cfg: ModelConfig, tp_group=None) -> None:
    """Copy a full HF state dict into this rank's ``GPTModel`` shard (cast to the model's dtypes).

    Args:
        model: ``GPTModel`` built by ``build_gpt_model(cfg)``.
        hf_state: full HF tensors (``load_hf_checkpoint``); each rank slices its own part.
        tp_group: the tensor-parallel process group (``None`` for TP=1).

    Raises:
        ValueError: naming Megatron parameters the conversion left unset or produced in excess.
    """
    tp_rank, tp_size = _tp_rank_size(tp_group)
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
    _, tp_size = _tp_rank_size(tp_group)
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
    files and :func:`hf_config_from_model_config` for ``hf_config`` (the original HF config or None).

    Args:
        dtype: tensor dtype in the safetensors files (default: as the model holds them).

    Returns:
        ``out_dir`` on global rank 0, ``None`` elsewhere.
    """
    shards = gather_model_shards(model, tp_group)
    out = None
    if _rank() == 0:
        hf_state = megatron_to_hf_state_dict(shards, cfg)
        if dtype is not None:
            hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
        config = hf_config_from_model_config(cfg, base=hf_config)
        if dtype is not None:
            config.dtype = str(dtype).removeprefix("torch.")
        out = write_hf_checkpoint(hf_state, config, out_dir, tokenizer_dir)
    _barrier()
    return out


# ------------------------------------------------------------------------- Megatron checkpoint (model only)
def save_megatron_checkpoint(model, cfg: ModelConfig, ckpt_dir: str | Path, hf_config=None) -> Path:
    """Write ``{"model": model.sharded_state_dict()}`` with ``dist_checkpointing`` (``torch_dist``), atomically.

    Collective over all ranks. Layout of ``ckpt_dir``: the ``dist_checkpointing`` files (resharding
    to any TP size on load), ``model_config.json`` (``ModelConfig`` fields) and, when given,
    ``hf_config.json`` (the original HF config, reused on export). On CPU it needs the cuda shim of
    ``packsft.model.cpu_compat`` and the calling script needs an ``if __name__ == "__main__"`` guard.
    """
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(f".{ckpt_dir.name}.tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(tmp))
    _barrier()
    if _rank() == 0:
        (tmp / MODEL_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        if hf_config is not None:
            base = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
            (tmp / HF_CONFIG_FILE).write_text(json.dumps(base, indent=2, default=str) + "\n")
        _replace_dir(tmp, ckpt_dir)
    _barrier()
    return ckpt_dir


def read_model_config(path: str | Path) -> ModelConfig:
    """``ModelConfig`` from a ``model_config.json``, a checkpoint folder holding one, or a YAML's ``model:`` section.

    Raises:
        ValueError: naming unknown fields.
    """
    path = Path(path)
    path = path / MODEL_CONFIG_FILE if path.is_dir() else path
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(path.read_text())
        data = data.get("model", data)
    else:
        data = json.loads(path.read_text())
    unknown = set(data) - {f.name for f in fields(ModelConfig)}
    if unknown:
        raise ValueError(f"{path}: unknown ModelConfig fields {sorted(unknown)}")
    return ModelConfig(**data)


def load_megatron_checkpoint(model, ckpt_dir: str | Path) -> None:
    """Load ``save_megatron_checkpoint``'s ``"model"`` entry into ``model`` (any TP size; strict)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt_dir))
    model.load_state_dict(loaded["model"])


def read_hf_config(path: str | Path) -> dict | None:
    """An HF ``config.json`` as a dict: ``path`` itself, or a checkpoint folder's ``hf_config.json`` (else ``None``)."""
    path = Path(path)
    path = path / HF_CONFIG_FILE if path.is_dir() else path
    return json.loads(path.read_text()) if path.is_file() else None

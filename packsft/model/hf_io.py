"""Hugging Face checkpoint files in and out of a (possibly TP- and PP-sharded) Megatron ``GPTModel``.

Read: a safetensors folder (``config.json`` and ``model.safetensors`` or the shards of
``model.safetensors.index.json``) or one GGUF file (transformers' dequantizing GGUF loader). Write:
``model.safetensors`` (sharded above ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and
the tokenizer files of ``TOKENIZER_FILES``, published atomically (``packsft.io.atomic_dir``). The tensor
mapping is :mod:`packsft.model.state_dict_adapter`, the config mapping :mod:`packsft.model.hf_config`.

Tensor and pipeline parallelism: import shards (every rank reads its pipeline stage's HF tensors on CPU
once (``stage_hf_names``; GGUF: all of them), takes its TP slice and frees the rest: peak host memory about
one copy of the stage's HF tensors per process); export gathers every rank's shard over the TP group
(``all_gather``, so each TP rank briefly holds its stage's full tensors), then the stages' tensors over
the pipeline group to global rank 0, which writes.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import torch
from torch import Tensor

from packsft.io import atomic_dir, read_json_object
from packsft.model.config import ModelConfig
from packsft.model.hf_config import TOKEN_ID_FIELDS, hf_config_from_model_config
from packsft.model.state_dict_adapter import (
    MissingTensorError,
    hf_tensor_names,
    hf_tensor_shape,
    hf_to_megatron_state_dict,
    megatron_to_hf_state_dict,
)
from packsft.process_groups import barrier, global_rank, rank_and_size

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
HF_CONFIG_FILE = "hf_config.json"
"""The source HF config kept in a Megatron checkpoint folder (see :func:`read_hf_config`)."""
HF_EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                   "model.safetensors.index.json", *TOKENIZER_FILES)
"""The names (``fnmatch`` patterns) of the files :func:`write_hf_checkpoint` writes: a folder holding nothing else is a
previous export, which a new one may replace."""


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's, else ``model.safetensors``, else every one."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> file name")
        names = sorted(set(weight_map.values()))
        return [directory / n for n in names]
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"]
    return sorted(directory.glob("*.safetensors"))


FLOATING_SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ")
"""The safetensors header dtypes read as weights (cast to the model's dtype); any other is refused."""


def _check_floating(name: str, dtype, where) -> None:
    """Refuse an HF tensor ``name`` whose dtype (a safetensors header string or a ``torch.dtype``) is not floating
    point: integer (quantized) or bool values cast to float would load as garbage weights.

    Raises:
        ValueError: naming ``where`` (the file, or the state dict), the tensor and its dtype.
    """
    floating = dtype in FLOATING_SAFETENSORS_DTYPES if isinstance(dtype, str) else dtype.is_floating_point
    if not floating:
        raise ValueError(f"{where}: tensor {name!r} has dtype {str(dtype).removeprefix('torch.')}, not floating "
                         "point; packsft imports unquantized weights (a quantized checkpoint must be dequantized "
                         "first, e.g. loaded in transformers and saved in bfloat16)")


def _gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names (a ``*.gguf`` file, or a folder with exactly one and no safetensors), else None.

    Raises:
        ValueError: ``path`` is a folder without safetensors holding several ``*.gguf`` files (named).
    """
    if path.suffix == ".gguf" and path.is_file():
        return path
    if path.is_dir() and not _safetensors_files(path):
        candidates = sorted(path.glob("*.gguf"))
        if len(candidates) > 1:
            raise ValueError(f"{path} holds {len(candidates)} .gguf files ({', '.join(c.name for c in candidates)}): "
                             "pass one of them, not the folder")
        return candidates[0] if candidates else None
    return None


def _read_gguf(gguf: Path, read):
    """``read()``, a transformers GGUF loader call on ``gguf``, with a bad file's errors (truncated, not GGUF,
    tensors of other shapes than the config it derives) as one ``ValueError`` naming the file."""
    try:
        return read()
    except (ValueError, RuntimeError, KeyError, IndexError, EOFError) as err:
        message = " ".join(str(err).split()) or type(err).__name__
        if "ignore_mismatched_sizes" in message:    # transformers' report of the mismatches is in its log
            raise ValueError(f"{gguf}: its tensors do not have the shapes of the config transformers' GGUF loader "
                             "derives from it (e.g. a Qwen3 GGUF whose head_dim is not 128); import the model's "
                             "safetensors folder instead") from None
        raise ValueError(message if str(gguf) in message else f"{gguf}: not readable as a GGUF model: {message}") \
            from None


def _check_gguf_head_dim(gguf: Path, config) -> None:
    """Refuse a GGUF whose ``<arch>.attention.key_length`` (its heads' width) differs from the ``head_dim`` of
    ``config``, the transformers config read from it (its Qwen3 reader ignores ``key_length`` and keeps 128).

    Raises:
        ValueError: naming the file and both widths.
    """
    from gguf import GGUFReader

    fields = _read_gguf(gguf, lambda: GGUFReader(str(gguf))).fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    key_length = fields.get(f"{arch}.attention.key_length")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if key_length is not None and int(key_length.contents()) != head_dim:
        raise ValueError(f"{gguf}: its attention heads are {key_length.contents()} wide ({arch}.attention.key_length), "
                         f"but transformers' GGUF loader builds head_dim {head_dim} for model_type "
                         f"{config.model_type!r} (it ignores key_length): packsft cannot import this GGUF (Qwen3 "
                         "GGUFs need head_dim 128); import the model's safetensors folder instead")


def _auto_config(folder: Path, **kwargs):
    """``AutoConfig.from_pretrained(folder)`` without running the folder's own code (a config's ``auto_map``:
    transformers would ask on stdin and run it on ``y``).

    Raises:
        ValueError: one line naming ``folder`` for a config that needs its own code, has a field of the wrong type
            or one transformers' validation divides by (a size of 0).
    """
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5's field validation
    except ImportError:  # an older huggingface_hub: transformers does not validate field types
        StrictDataclassError = ()  # noqa: N806 - catches nothing
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False, **kwargs)
    except StrictDataclassError as e:  # e.g. "rms_norm_eps": "abc"
        detail = e.__cause__ or e
        raise ValueError(f"{folder}: config.json has an invalid field: {' '.join(str(detail).split())}") from None
    except ArithmeticError as e:  # transformers' own checks, e.g. hidden_size % num_attention_heads with 0 heads
        raise ValueError(f"{folder}: config.json has an invalid field: transformers' validation failed with "
                         f"{type(e).__name__} ({e}): a size of 0?") from None
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"{folder}: its config.json needs the checkpoint's own code (auto_map), which packsft never "
                         "runs; convert a model type transformers itself supports") from e


def load_hf_config(path: str | Path):
    """The transformers config of a local HF checkpoint (safetensors folder or GGUF file), without its tensors.

    Raises:
        ValueError: a folder of several GGUF files, an unreadable GGUF, or one whose head width transformers
            misreads (:func:`_check_gguf_head_dim`), naming the file; a folder without ``config.json``; a config
            that needs its own code.
    """
    path = Path(path)
    gguf = _gguf_file(path)
    if gguf is not None:
        config = _read_gguf(gguf, lambda: _auto_config(gguf.parent, gguf_file=gguf.name))
        _check_gguf_head_dim(gguf, config)
        return config
    if path.is_dir() and not (path / "config.json").is_file():   # transformers: "Should have a model_type key"
        raise ValueError(f"{path}: no config.json (an HF checkpoint folder holds config.json and the model's "
                         "*.safetensors; or pass a *.gguf file)")
    return _auto_config(path)


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


def model_hf_names(cfg: ModelConfig):
    """Predicate on HF tensor names: those a whole model of ``cfg`` has (:func:`hf_tensor_shape` gives them a shape),
    plus the rotary ``inv_freq`` buffers older checkpoints hold (computed from the config, not read)."""
    return lambda name: hf_tensor_shape(name, cfg) is not None or name.endswith("rotary_emb.inv_freq")


LFS_POINTER = b"version https://git-lfs"
"""How a Git LFS pointer file (what a clone without ``git-lfs`` holds instead of the weights) begins."""


def check_hf_weight_files(path: str | Path, cfg: ModelConfig) -> None:
    """Check a safetensors checkpoint's weight files against ``cfg`` from their headers alone (no tensor is read).

    Every file of the checkpoint (:func:`_safetensors_files`) must open with ``safetensors.safe_open`` (which checks
    that the file is as long as its header says), every tensor must be floating point and one that a model of ``cfg``
    has (:func:`model_hf_names`), in the shape ``cfg`` implies (``hf_tensor_shape``), and every tensor ``cfg`` needs
    (``hf_tensor_names``) must be there. Cheap (headers only, memory-mapped), so it runs on every rank before the model
    is built. A GGUF checkpoint is left to transformers' reader.

    Raises:
        FileNotFoundError: ``path`` holds neither safetensors nor a GGUF file.
        ValueError: naming the file: a Git LFS pointer, not a safetensors file (junk, truncated, a corrupt header), a
            tensor that is not floating point (quantized weights) or has another shape than ``cfg`` implies; naming
            the folder: tensors ``cfg`` does not use (another architecture) or lacks.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if _gguf_file(path) is not None:
        return
    files = _safetensors_files(path) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and no *.gguf file")
    used, found, unused = model_hf_names(cfg), set(), []
    for f in files:
        with open(f, "rb") as handle:   # a missing file (named by the index) raises FileNotFoundError naming it
            if handle.read(len(LFS_POINTER)) == LFS_POINTER:
                raise ValueError(f"{f}: a Git LFS pointer, not the weights (the model was cloned without git-lfs): "
                                 f"run `git lfs pull` in its repository, or download the file itself")
        try:
            with safe_open(str(f), framework="pt") as st:
                header = {k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in st.keys()}
        except SafetensorError as err:
            raise ValueError(f"{f}: not a readable safetensors file ({err})") from None
        for name, (dtype, shape) in header.items():
            _check_floating(name, dtype, f)
            if not used(name):
                unused.append(name)
            elif (expected := hf_tensor_shape(name, cfg)) is not None and shape != expected:
                raise ValueError(f"{f}: HF tensor {name!r} has shape {shape}, but the config implies {expected}")
        found.update(header)
    if unused:
        raise ValueError(f"{path}: {len(unused)} tensor(s) that its config.json does not use, e.g. {unused[:4]}: "
                         "a checkpoint of another architecture than the config describes (num_hidden_layers, "
                         "attention_bias, ...); packsft refuses rather than drop weights")
    missing = [n for n in hf_tensor_names(cfg) if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: HF checkpoint has no tensor {missing[0]!r}{more}, which its config needs")


def load_hf_checkpoint(path: str | Path, keep=None) -> tuple[object, dict[str, Tensor]]:
    """Read a local HF causal-LM checkpoint: a safetensors directory or a GGUF file.

    Safetensors: ``config.json`` through ``AutoConfig`` and the tensors (as stored, usually bf16)
    through ``safetensors.safe_open``, honouring ``model.safetensors.index.json``; only the names for which
    ``keep(name)`` is true are read (default: all; :func:`stage_hf_names` for one pipeline stage). The files are
    read as they are: check them first with :func:`check_hf_weight_files` (the import does, before it builds the
    model). GGUF (a
    ``*.gguf`` path, or a directory holding one GGUF and no safetensors): transformers' GGUF loader
    (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``, needs the ``gguf``
    package), which dequantizes every tensor to fp32 and undoes llama.cpp's q/k permutation (all of it is
    read; ``keep`` filters afterwards).

    Returns:
        ``(hf_config, state_dict)``: the transformers config and HF names -> full CPU tensors.

    Raises:
        FileNotFoundError: if ``path`` holds neither safetensors nor a GGUF file.
        ValueError: naming the file: a safetensors file that is not readable; a folder of several GGUF files, or a
            GGUF that transformers cannot read (truncated; tensors of other shapes than the config it derives).
    """
    path = Path(path)
    keep = keep or (lambda name: True)
    gguf = _gguf_file(path)
    if gguf is not None:
        from transformers import AutoModelForCausalLM

        model = _read_gguf(gguf, lambda: AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, trust_remote_code=False))
        return model.config, {k: v.detach() for k, v in model.state_dict().items() if keep(k)}
    files = _safetensors_files(path) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and no *.gguf file")
    from safetensors import SafetensorError, safe_open

    state: dict[str, Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                state.update({k: handle.get_tensor(k) for k in handle.keys() if keep(k)})
        except SafetensorError as err:
            raise ValueError(f"{f}: not a readable safetensors file ({err})") from None
    return _auto_config(path), state


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


def _tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    """The files of ``TOKENIZER_FILES`` present in ``tokenizer_dir``.

    Raises:
        FileNotFoundError: if it holds none of ``tokenizer.json``/``tokenizer.model``/``vocab.json``.
    """
    files = [Path(tokenizer_dir) / n for n in TOKENIZER_FILES if (Path(tokenizer_dir) / n).is_file()]
    if not {f.name for f in files} & {"tokenizer.json", "tokenizer.model", "vocab.json"}:
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} has no tokenizer.json, tokenizer.model "
                                "or vocab.json")
    return files


def tokenizer_token_ids(tokenizer_dir: str | Path, vocab_size: int) -> dict[str, int | None]:
    """The export tokenizer's ``TOKEN_ID_FIELDS`` (bos/eos/pad id, None where it has none), for ``config.json``.

    The tokenizer is loaded as training loads it (``packsft.tokenizer.load_tokenizer``).

    Raises:
        FileNotFoundError: if ``tokenizer_dir`` holds no tokenizer file (see :func:`_tokenizer_files`).
        ValueError: if ``len(tokenizer)`` exceeds ``vocab_size`` (the model has no row for its top ids;
            training refuses the same tokenizer).
    """
    from packsft.tokenizer import load_tokenizer

    _tokenizer_files(tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer {tokenizer_dir} "
                         f"({len(tokenizer)} tokens): its top ids have no embedding row")
    return {field: getattr(tokenizer, field) for field in TOKEN_ID_FIELDS}


def write_hf_checkpoint(hf_state: dict[str, Tensor], hf_config, out_dir: str | Path,
                        tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF checkpoint folder atomically (a temp folder beside ``out_dir``, then a rename).

    Files: ``model.safetensors`` (or shards + ``model.safetensors.index.json`` past ``max_shard_bytes``),
    ``config.json`` (``hf_config.save_pretrained``), ``generation_config.json`` and, from ``tokenizer_dir``, every
    file of ``TOKENIZER_FILES`` present there (tokenizer, its config with the embedded chat template, and
    ``chat_template.jinja``). ``generation_config.json`` is ``tokenizer_dir``'s own when it holds one (the original
    model's folder: its stop tokens and sampling defaults, which transformers' ``generate`` used for it), read and
    rewritten by ``GenerationConfig``; else ``GenerationConfig.from_model_config(hf_config)``. Modes: the folder
    ``0777 & ~umask`` (0755), every file ``0666 & ~umask`` (0644), whatever the tokenizer files' own modes. A
    ``quantization_config`` (e.g. of a GGUF source) is dropped when no tensor is quantized (all floating point),
    so loaders do not try to dequantize plain weights.

    Raises:
        FileNotFoundError: if ``tokenizer_dir`` holds none of ``tokenizer.json``/``tokenizer.model``/``vocab.json``.
        OSError: if its ``generation_config.json`` is not valid.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tok_files = _tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else []
    generation = GenerationConfig.from_model_config(hf_config)
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(tokenizer_dir), local_files_only=True)
    if hasattr(hf_config, "quantization_config") and all(t.is_floating_point() for t in hf_state.values()):
        hf_config = copy.deepcopy(hf_config)
        del hf_config.quantization_config
    with atomic_dir(out_dir) as tmp:
        _write_safetensors(hf_state, tmp, max_shard_bytes)
        hf_config.save_pretrained(str(tmp))
        generation.save_pretrained(str(tmp))
        for f in tok_files:
            shutil.copyfile(f, tmp / f.name)   # their modes as any file's: atomic_dir gives 0666 & ~umask
    return out_dir


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

    Raises:
        ValueError: naming an HF tensor the model needs that ``hf_state`` lacks, holds in another shape than the
            config implies or in a dtype that is not floating point (quantized: never cast), a tied config whose
            ``lm_head.weight`` differs from the embedding, or Megatron parameters the conversion left unset or
            produced in excess.
    """
    tp_rank, tp_size = rank_and_size(tp_group)
    layers, first, last = stage_parts(model)
    tied_copy = last and not first and cfg.tie_word_embeddings
    head, embed = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not torch.equal(head, embed):
        raise ValueError("the config ties the output layer to the embedding (tie_word_embeddings true), but the "
                         "checkpoint's lm_head.weight differs from model.embed_tokens.weight (transformers then "
                         "keeps them apart); set tie_word_embeddings to false in its config.json")
    needed = stage_hf_names(model, cfg)
    for name, t in hf_state.items():
        if needed(name):
            _check_floating(name, t.dtype, "the HF state dict")
        expected = hf_tensor_shape(name, cfg) if needed(name) else None
        if expected is not None and tuple(t.shape) != expected:
            raise ValueError(f"HF tensor {name!r} has shape {tuple(t.shape)}, but the config implies {expected}")
    try:
        state = hf_to_megatron_state_dict(hf_state, cfg, tp_rank, tp_size, layers=layers,
                                          embedding=first or tied_copy, head=last)
    except MissingTensorError as err:     # a bad checkpoint (a user error), not a bug
        raise ValueError(f"{err.args[0]}, which its config needs") from None
    state = _renumber(state, {g: j for j, g in enumerate(layers)})
    if tied_copy:
        state["output_layer.weight"] = state.pop("embedding.word_embeddings.weight")
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"HF -> Megatron conversion mismatch: missing {missing}, unexpected "
                         f"{list(result.unexpected_keys)}")


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


def read_hf_config(path: str | Path) -> dict | None:
    """An HF ``config.json`` as a dict: ``path`` itself, or a checkpoint folder's ``hf_config.json`` (else ``None``)."""
    path = Path(path)
    path = path / HF_CONFIG_FILE if path.is_dir() else path
    return read_json_object(path) if path.is_file() else None


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

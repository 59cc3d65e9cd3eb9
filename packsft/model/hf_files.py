"""Hugging Face checkpoint files on disk: read a safetensors folder or a GGUF file, check its weight files against a
``ModelConfig`` from their headers, write an HF folder atomically.

Read: a safetensors folder (``config.json`` and ``model.safetensors`` or the shards of
``model.safetensors.index.json``) or one GGUF file (transformers' dequantizing GGUF loader). Write:
``model.safetensors`` (sharded above ``max_shard_bytes``), ``config.json``, ``generation_config.json`` and
the tokenizer files of ``TOKENIZER_FILES``, published atomically (``packsft.io.atomic_dir``). Every check of an
input file is here, where it is opened (:func:`load_hf_config`, :func:`check_hf_weight_files`; a LLaVA folder's
weights: ``hf_llava.check_hf_llava_weight_files`` over :func:`check_weight_headers`); the model side (TP shards, PP
stages) is :mod:`packsft.model.hf_io`.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from packsft.io import atomic_dir, read_json_object
from packsft.model.config import ModelConfig, check_vocab_size
from packsft.model.hf_config import TOKEN_ID_FIELDS
from packsft.model.state_dict_adapter import hf_tensor_names, hf_tensor_shape

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""A multimodal processor's own files (``LlavaProcessor``, its image processor), written beside the tokenizer's."""
HF_CONFIG_FILE = "hf_config.json"
"""The source HF config kept in a Megatron checkpoint folder (see :func:`read_hf_config`)."""
HF_EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
                   "model.safetensors.index.json", *TOKENIZER_FILES, *PROCESSOR_FILES)
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
            message = (f"{gguf}: its tensors do not have the shapes of the config transformers' GGUF loader derives "
                       "from it (e.g. a Qwen3 GGUF whose head_dim is not 128); import the model's safetensors folder "
                       "instead")
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



def model_hf_names(cfg: ModelConfig):
    """Predicate on HF tensor names: those a whole model of ``cfg`` has (:func:`hf_tensor_shape` gives them a shape),
    plus the rotary ``inv_freq`` buffers older checkpoints hold (computed from the config, not read)."""
    return lambda name: hf_tensor_shape(name, cfg) is not None or name.endswith("rotary_emb.inv_freq")


LFS_POINTER = b"version https://git-lfs"
"""How a Git LFS pointer file (what a clone without ``git-lfs`` holds instead of the weights) begins."""


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint folder ``path`` (:func:`_safetensors_files`).

    Raises:
        FileNotFoundError: ``path`` holds none (and is not a GGUF checkpoint, which callers test first).
    """
    files = _safetensors_files(path) if path.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files and no *.gguf file")
    return files


@contextmanager
def _open_safetensors(f: Path):
    """``safetensors.safe_open(f)``, its errors (junk, truncated, a corrupt header) as a ``ValueError`` naming ``f``;
    a Git LFS pointer in place of the weights is named as one.

    Raises:
        ValueError: naming ``f``. FileNotFoundError: ``f`` does not exist (an index names a missing shard).
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(f), framework="pt") as handle:
            yield handle
    except SafetensorError as err:
        with open(f, "rb") as head:
            if head.read(len(LFS_POINTER)) == LFS_POINTER:
                raise ValueError(f"{f}: a Git LFS pointer, not the weights (the model was cloned without git-lfs): "
                                 "run `git lfs pull` in its repository, or download the file itself") from None
        raise ValueError(f"{f}: not a readable safetensors file ({err})") from None


def weight_file_headers(path: str | Path) -> list[tuple[Path, dict[str, tuple[str, tuple[int, ...]]]]]:
    """``(file, {tensor name: (safetensors dtype, shape)})`` of every safetensors file of the checkpoint folder
    ``path`` (:func:`_safetensors_files`), from the headers alone (memory-mapped, no tensor read).

    Raises:
        FileNotFoundError: ``path`` holds no safetensors file (or an index names a missing one).
        ValueError: naming the file: a Git LFS pointer, not a safetensors file (junk, truncated, a corrupt header).
    """
    out = []
    for f in _weight_files(Path(path)):
        with _open_safetensors(f) as st:
            out.append((f, {k: (st.get_slice(k).get_dtype(), tuple(st.get_slice(k).get_shape())) for k in st.keys()}))
    return out


WEIGHT_BUFFERS = ("rotary_emb.inv_freq", "embeddings.position_ids")
"""Name endings of the buffers some checkpoints hold (rotary frequencies, CLIP position ids): computed from the
config, never read, so neither their dtype nor their shape is checked."""


def check_weight_headers(path: str | Path, shape_of: Callable[[str], tuple[int, ...] | None], needed: Iterable[str],
                         *, canonical: Callable[[str], str] = str, spare: tuple[str, ...] = (),
                         arch_hint: str = "", name_hint: str = "") -> None:
    """Check a safetensors checkpoint folder's weight files from their headers alone (no tensor is read): every file
    opens (:func:`weight_file_headers`), every tensor but :data:`WEIGHT_BUFFERS` is floating point (quantized or
    bool values cast to float would be garbage) and used, in its shape, and every ``needed`` tensor is there.

    Args:
        shape_of: a tensor's shape in the model from its ``canonical`` name; None: the model does not use it.
        needed: the canonical names the model needs.
        canonical: a file's tensor name -> the name ``shape_of`` and ``needed`` use (default: itself).
        spare: prefixes of canonical names the model does not use but a checkpoint may hold (left unread).
        arch_hint, name_hint: the ends of the unused and missing tensors' messages (``" (transformers 5 name)"``).

    Raises:
        FileNotFoundError: ``path`` holds no safetensors file (or an index names a missing one).
        ValueError: naming the file: a Git LFS pointer, not a safetensors file, a tensor that is not floating point
            or has another shape than ``shape_of``; naming the folder: tensors the model does not use (another
            architecture) or lacks.
    """
    found, unused = set(), []
    for f, header in weight_file_headers(path):
        for name, (dtype, shape) in header.items():
            key = canonical(name)
            if key.endswith(WEIGHT_BUFFERS):
                continue
            if dtype not in FLOATING_SAFETENSORS_DTYPES:
                raise ValueError(f"{f}: tensor {name!r} has dtype {dtype}, not floating point; packsft imports "
                                 "unquantized weights (a quantized checkpoint must be dequantized first, e.g. loaded "
                                 "in transformers and saved in bfloat16)")
            expected = shape_of(key)
            if expected is None and not key.startswith(spare):
                unused.append(name)
            elif expected is not None and shape != expected:
                raise ValueError(f"{f}: HF tensor {name!r} has shape {shape}, but the config implies {expected}")
            found.add(key)
    if unused:
        raise ValueError(f"{path}: {len(unused)} tensor(s) that its config.json does not use, e.g. {unused[:4]}: "
                         f"a checkpoint of another architecture than the config describes{arch_hint}; packsft refuses "
                         "rather than drop weights")
    missing = [n for n in needed if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: HF checkpoint has no tensor {missing[0]!r}{more}{name_hint}, which its config "
                         "needs")


def check_hf_weight_files(path: str | Path, cfg: ModelConfig) -> None:
    """Check a safetensors checkpoint's weight files against ``cfg`` from their headers alone
    (:func:`check_weight_headers`): every tensor one that a model of ``cfg`` has, in the shape ``cfg`` implies
    (``hf_tensor_shape``), every tensor ``cfg`` needs (``hf_tensor_names``) there. Cheap (headers only,
    memory-mapped), so it runs on every rank before the model is built. A GGUF checkpoint is left to transformers'
    reader.

    Raises:
        FileNotFoundError, ValueError: as :func:`check_weight_headers`.
    """
    if _gguf_file(Path(path)) is None:
        check_weight_headers(path, lambda name: hf_tensor_shape(name, cfg), hf_tensor_names(cfg),
                             arch_hint=" (num_hidden_layers, attention_bias, ...)")


def load_hf_checkpoint(path: str | Path, keep=None) -> tuple[object, dict[str, Tensor]]:
    """Read a local HF causal-LM checkpoint: a safetensors directory or a GGUF file.

    Safetensors: ``config.json`` through ``AutoConfig`` and the tensors (as stored, usually bf16)
    through ``safetensors.safe_open``, honouring ``model.safetensors.index.json``; only the names for which
    ``keep(name)`` is true are read (default: all; ``packsft.model.hf_io.stage_hf_names`` for one pipeline
    stage). The files are read as they are: check them first with :func:`check_hf_weight_files` (the import does,
    before it builds the model). GGUF (a ``*.gguf`` path, or a directory holding one GGUF and no safetensors):
    transformers' GGUF loader
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
    state: dict[str, Tensor] = {}
    for f in _weight_files(path):
        with _open_safetensors(f) as handle:
            state.update({k: handle.get_tensor(k) for k in handle.keys() if keep(k)})
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
    check_vocab_size(vocab_size, tokenizer, tokenizer_dir)
    return {field: getattr(tokenizer, field) for field in TOKEN_ID_FIELDS}


def write_hf_checkpoint(hf_state: dict[str, Tensor], hf_config, out_dir: str | Path,
                        tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 5 * 2**30, *,
                        processor: bool = False) -> Path:
    """Write an HF checkpoint folder atomically (a temp folder beside ``out_dir``, then a rename).

    Files: ``model.safetensors`` (or shards + ``model.safetensors.index.json`` past ``max_shard_bytes``),
    ``config.json`` (``hf_config.save_pretrained``), ``generation_config.json`` and, from ``tokenizer_dir``, every
    file of ``TOKENIZER_FILES`` present there (tokenizer, its config with the embedded chat template, and
    ``chat_template.jinja``), with ``processor`` (an image-text model) also those of ``PROCESSOR_FILES`` present
    there. ``generation_config.json`` is ``tokenizer_dir``'s own when it holds one (the original
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
    if processor and tokenizer_dir is not None:
        tok_files += [Path(tokenizer_dir) / n for n in PROCESSOR_FILES if (Path(tokenizer_dir) / n).is_file()]
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



def read_hf_config(path: str | Path) -> dict | None:
    """An HF ``config.json`` as a dict: ``path`` itself, or a checkpoint folder's ``hf_config.json`` (else ``None``)."""
    path = Path(path)
    path = path / HF_CONFIG_FILE if path.is_dir() else path
    return read_json_object(path) if path.is_file() else None


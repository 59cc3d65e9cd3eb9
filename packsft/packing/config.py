"""The packer's settings (:class:`PackConfig`: each field declares its command-line flag, :func:`cli`, from which
``packsft.packing.cli`` generates the parser; checked once by :meth:`PackConfig.validate`), its errors and the paths
a run writes (:func:`output_paths`)."""

from __future__ import annotations

import argparse
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from packsft.config_rules import Exclusive, Needs, Rule, check_fields, ge, one_of, positive_int, rules
from packsft.io import check_writable_dir
from packsft.jsonl import NON_FINITE, NonFiniteNumber, loads_strict
from packsft.layout import check_max_seq_len
from packsft.packing.algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from packsft.packing.sources import check_source, takes_split
from packsft.prompt_formats import PRESETS, TRAIN_ON, TokenizationSpec
from packsft.record_formats import RECORD_FORMATS, record_converter
from packsft.sidecar import REPORT_SUFFIX, row_index_path, sidecar_path
from packsft.token_cache import cache_paths

OVERSIZE_POLICIES = ("own-row", "drop", "error", "split")
"""``--oversize``: what becomes of a conversation longer than a row (``own-row``, the default, NeMo RL's)."""
SPLIT_FORMATS = ("chat-template", "default", "passthrough")
"""The prompt formats ``--oversize split`` works with: those where ``weight: 0`` masks a piece's context."""
MAX_CONVERSATION_BYTES = 4 << 20
"""Default ``--max-conversation-bytes``: longer input lines are rejected before they are parsed (4 MiB)."""
ENGINES = ("local", "ray")
"""``--engine``: this machine (:mod:`packsft.packing.local_engine`) or a Ray cluster
(:mod:`packsft.packing.ray_engine`)."""
HISTOGRAM_SUFFIX = ".lengths.png"
_PROMPT_RESPONSE = "--input-key/--output-key read prompt/response records (--format input-output)"


def cli(flag: str, help: str | None = None, value: Callable[[argparse.Namespace], Any] | None = None,
        checks: tuple[Rule, ...] = (), **kwargs: Any) -> dict[str, Any]:
    """A :class:`PackConfig` field's command-line flag (its ``field`` metadata): ``add_argument(flag, help=help,
    **kwargs)``. Without ``value`` the flag gives the field as is, its default the field's (required without one);
    ``value(namespace)`` makes the field of flags that declare their own defaults. The field's rules
    (:func:`~packsft.config_rules.check_fields`, naming it by its flag) are ``checks``, after ``choices`` as
    :func:`~packsft.config_rules.one_of`: argparse refuses a bad value on the command line, ``validate`` a
    ``PackConfig`` built in Python."""
    choices = (one_of(kwargs["choices"]),) if "choices" in kwargs else ()
    return {"flags": ((flag, {"help": help, **kwargs}),), "value": value,
            **rules(*choices, *checks, name=flag)}


def json_object(text: str) -> dict:
    """An argparse ``type``: a JSON object (``--chat-template-kwargs``), standard JSON only."""
    try:
        value = loads_strict(text)
    except (ValueError, RecursionError) as e:  # not JSON, NaN, a duplicate key, nested too deeply, too many digits
        why = NON_FINITE if isinstance(e, NonFiniteNumber) else \
            f"not JSON ({getattr(e, 'msg', None) or e or 'nested too deeply'})"
        raise argparse.ArgumentTypeError(f"{why}: {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"enable_thinking\": false}}': {text!r}")
    return value


@dataclass(kw_only=True)
class PackConfig:
    """Settings of one packing run, each field with its command-line flag (:func:`cli`: the packer's argparse is
    generated from these fields, ``packsft.packing.cli``).

    Attributes:
        inputs: input JSONL files, read in order; also ``datasets`` ``save_to_disk`` folders and ``.parquet`` /
            ``.arrow`` files (:mod:`packsft.packing.sources`, located by row index instead of line).
        split: the split to read of a ``DatasetDict`` folder or an Energon dataset input (Energon: ``train`` if None).
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
        oversize: ``own-row``, ``drop``, ``error`` or ``split`` for conversations longer than ``max_seq_len``
            (``split``: cut between turns into pieces that fit, :mod:`packsft.packing.split`).
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

    inputs: list[str] = field(metadata=cli(
        "--input", "input JSONL file(s), read in order; also .parquet / .arrow files and datasets save_to_disk "
        "folders (rows; needs the packsft[datasets] extra) and Energon datasets (samples; packsft[energon])",
        nargs="+", checks=(Rule(bool, "at least one file"),)))
    split: str | None = field(default=None, metadata=cli(
        "--split", "the split to read of a DatasetDict save_to_disk folder or an Energon dataset (train if not "
        "given)"))
    output: str = field(metadata=cli("--output", "output .jsonl.packed file"))
    tokenizer: str = field(metadata=cli("--tokenizer", "local tokenizer folder or tokenizer.json"))
    max_seq_len: int = field(metadata=cli("--max-seq-length", "row length in tokens", type=int))
    prompt_format: str = field(default="chat-template", metadata=cli("--prompt-format", choices=PRESETS + ("default",)))
    chat_template: str | None = field(default=None, metadata=cli(
        "--chat-template", "Jinja template string or file (chat-template only)"))
    chat_template_kwargs: dict[str, Any] | None = field(default=None, metadata=cli(
        "--chat-template-kwargs", "JSON object passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'",
        type=json_object, checks=(Rule(lambda v: isinstance(v, dict), "a JSON object (a dict)"),)))
    train_on: str = field(default="all", metadata=cli(
        "--train-on", "train all assistant turns, or only the last of each conversation", choices=TRAIN_ON))
    append_eos: bool | None = field(default=None, metadata=cli(
        "--append-eos", "append EOS to every trained assistant turn (default: when the template writes no end of "
        "turn after it, and for passthrough)", action=argparse.BooleanOptionalAction))
    pad_token: str | None = field(default=None, metadata=cli("--pad-token", "override the prompt format's pad token"))
    context_parallel_size: int = field(default=1, metadata=cli("--context-parallel-size", type=positive_int))
    sequence_parallel_size: int = field(default=1, metadata={"flags": (
        ("--tensor-model-parallel-size", {"type": positive_int, "default": 1,
                                          "help": "TP size of the training run; only used with --sequence-parallel"}),
        ("--sequence-parallel", {"action": "store_true", "help": "rows for Megatron sequence parallelism: "
                                 "max_seq_len a multiple of lcm(2*CP, CP*TP)"})),
        "value": lambda a: a.tensor_model_parallel_size if a.sequence_parallel else 1})
    algorithm: str = field(default=DEFAULT_ALGORITHM, metadata=cli(
        "--algorithm", "bfd-local-search (default: best-fit decreasing, then rows emptied down to the lower bound "
        "where it can), best-fit-decreasing, or next-fit (input order, NeMo RL's)", choices=ALGORITHMS))
    oversize: str = field(default="own-row", metadata=cli(
        "--oversize", "conversations longer than --max-seq-length: own row (truncated), drop, error, or split "
        "(cut between turns into pieces of at most --max-seq-length tokens, each assistant turn trained once, the "
        "context before it masked)",
        choices=OVERSIZE_POLICIES))
    max_conversation_bytes: int = field(default=MAX_CONVERSATION_BYTES, metadata=cli(
        "--max-conversation-bytes", f"reject input lines longer than this many bytes before parsing them (default "
        f"{MAX_CONVERSATION_BYTES}, 4 MiB)", type=int, checks=(ge(1),)))
    seed: int = field(default=1234, metadata=cli("--seed", type=int))
    shuffle_rows: bool = field(default=False, metadata=cli(
        "--shuffle-rows", "write rows in a seeded random order", action="store_true"))
    num_workers: int = field(default=0, metadata=cli(
        "--num-workers", "worker processes that read, tokenize and count shards of the input (0: this process)",
        type=int, checks=(ge(0),)))
    engine: str = field(default="local", metadata=cli(
        "--engine", "local: this machine (--num-workers processes); ray: Ray Data tasks on a Ray cluster "
        "(packsft[ray] extra; --num-workers actors, default one per cluster CPU); same output", choices=ENGINES))
    ray_address: str | None = field(default=None, metadata=cli(
        "--ray-address", "Ray cluster to join with --engine ray (e.g. auto; default: $RAY_ADDRESS, else a local one)"))
    shard_bytes: int | None = field(default=None, metadata=cli(
        "--shard-bytes", "input bytes per shard, a worker's unit of work (default: 1/64 of the input, 256 KiB-64 MiB, "
        "the last 2 shards' worth cut in quarters); the output does not depend on it", type=int, checks=(ge(1),)))
    record_format: str = field(default="messages", metadata=cli(
        "--format", "record shape: messages (OpenAI), input-output (with --input-key/--output-key), sharegpt "
        "(conversations: [{from, value}]) or alpaca (instruction, input, output)", dest="record_format",
        choices=RECORD_FORMATS))
    adapter: str | None = field(default=None, metadata=cli(
        "--adapter", "a function turning one record into {'messages': [...], 'tools': [...]}, from PYTHONPATH "
        "(or FILE.py:FN)", metavar="PKG.MODULE:FN"))
    input_key: str | None = field(default=None, metadata=cli("--input-key", "prompt field of prompt/response records"))
    output_key: str | None = field(default=None, metadata=cli(
        "--output-key", "response field of prompt/response records"))
    default_system_prompt: str = field(default="", metadata=cli(
        "--default-system-prompt", "system prompt for conversations without one"))
    strict: bool = field(default=False, metadata=cli(
        "--strict", "stop at the first invalid record", action="store_true"))
    allow_non_megatron: bool = field(default=False, metadata=cli(
        "--allow-non-megatron", "Megatron presets: keep (and count) conversations Megatron-LM's SFTTokenizer refuses "
        "instead of rejecting them; the file is then packsft-only", action="store_true"))
    report: str | None = field(default=None, metadata=cli(
        "--report", "JSON report path (default <output>.report.json)"))
    histogram: str | None = field(default=None, metadata=cli(
        "--histogram", "PNG path (default <output>.lengths.png; '' for none)"))
    token_cache: bool = field(default=True, metadata=cli(
        "--no-token-cache", "do not write <output>.tokens.npy / .tokens-index.npy (the loader then re-tokenizes)",
        value=lambda a: not a.no_token_cache, action="store_true"))
    progress: bool = field(default=True, metadata=cli(
        "--no-progress", value=lambda a: not a.no_progress, action="store_true"))

    @property
    def tokenization(self) -> TokenizationSpec:
        """The run's tokenizer and prompt format settings as one spec (``--allow-non-megatron`` is the packer's
        policy for such conversations, not the format's: the workers bind both)."""
        return TokenizationSpec(self.tokenizer, self.prompt_format, self.pad_token, self.chat_template,
                                self.chat_template_kwargs, self.train_on, self.append_eos)

    relations: ClassVar = (
        Needs(("record_format", "input-output"), "input_key"),
        Needs("input_key", "output_key"),
        Needs("output_key", "input_key"),
        Needs("ray_address", ("engine", "ray")),
        Exclusive("input_key", "adapter", f"{_PROMPT_RESPONSE}; --adapter records have their own fields"),
        Needs("adapter", ("record_format", "messages"), "--adapter replaces --format (leave --format out)"),
        Needs("input_key", ("record_format", one_of(("messages", "input-output"))),
              f"{_PROMPT_RESPONSE}; other --format records have their own fields"),
        Needs(("oversize", "split"), ("prompt_format", one_of(SPLIT_FORMATS)),
              "a piece masks its context with 'weight: 0', which the Megatron presets cannot (they train every "
              "assistant turn)"),
    )

    def validate(self) -> None:
        """Check the settings: the fields' rules and :attr:`relations` (:func:`~packsft.config_rules.check_fields`),
        the inputs (they exist and are not outputs), the row length, the record format or adapter, and the output
        paths.

        Raises:
            ValueError: naming the flag and its value.
        """
        check_fields("", self)
        for p in self.inputs:
            check_source(p, self.split)
        if self.split is not None and not any(takes_split(p) for p in self.inputs):
            raise ValueError(f"--split {self.split}: no --input is a DatasetDict folder (dataset_dict.json) or an "
                             "Energon dataset (.nv-meta)")
        check_max_seq_len(self.max_seq_len, self.context_parallel_size, self.sequence_parallel_size)
        record_converter(self.record_format, self.adapter)          # an unknown adapter fails here
        for name, value in (("--default-system-prompt", self.default_system_prompt),
                            ("--chat-template-kwargs", self.chat_template_kwargs)):
            try:
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except (UnicodeEncodeError, TypeError) as e:
                raise ValueError(f"{name}: not valid text ({e})") from None
        written = {_OUTPUT_NAMES[key]: path for key, path in output_paths(self).items()}
        clashes = [(out, f"also the {what} path {out}: packing would overwrite its own input; write the output "
                         "elsewhere") for what, out in written.items()]
        clashes.append((row_index_path(self.output), f"the path of the loader's row index of {self.output}: loading "
                        "the rows would overwrite it; rename the input or write the output elsewhere"))
        for i, p in enumerate(self.inputs):   # an input that is an earlier input, an output or the row index
            earlier = [(q, f"given twice (also as {q}): its conversations would be packed twice; to train on a "
                           "source more often, weight it in the training mixture") for q in self.inputs[:i]]
            for other, why in earlier + clashes:
                if _same_file(p, other):
                    raise ValueError(f"--input {p} is {why}")
        targets: dict[tuple[Path, str], str] = {}
        for what, out in written.items():
            _check_output_target(what, out)     # refuses an --output that is a folder
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
        flag = {"rows": "--output", "report": "--report", "histogram": "--histogram"}.get(name, "--output")
        check_writable_dir(folder, f"{flag} {path}: its folder", PackError)


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

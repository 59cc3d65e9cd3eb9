"""Command line of the packer (``tools/pack_megatron_sft_jsonl.py`` and the ``packsft-pack`` script).

See ``tools/pack_megatron_sft_jsonl.py`` for examples.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import warnings
from pathlib import Path

from packsft.conversation import NON_FINITE, NonFiniteNumber, loads_strict
from packsft.packing.algorithms import ALGORITHMS, DEFAULT_ALGORITHM
from packsft.packing.config import (
    ENGINES,
    MAX_CONVERSATION_BYTES,
    OVERSIZE_POLICIES,
    PackConfig,
    PackError,
    PackWarning,
    output_folders,
)
from packsft.packing.pipeline import run_pack
from packsft.packing.signals import Terminated
from packsft.prompt_formats import PRESETS, TRAIN_ON
from packsft.record_formats import RECORD_FORMATS


def _json_object(text: str) -> dict:
    try:
        value = loads_strict(text)
    except NonFiniteNumber:
        raise argparse.ArgumentTypeError(f"{NON_FINITE}: {text!r}") from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from e
    except (ValueError, RecursionError) as e:  # a duplicate key, nested too deeply, too many digits
        raise argparse.ArgumentTypeError(f"not JSON here ({e or 'nested too deeply'}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"enable_thinking\": false}}': {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (the tools' parallel sizes)."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> PackConfig:
    """Parse the command line into a :class:`PackConfig`."""
    p = argparse.ArgumentParser(description="Pack chat conversations (OpenAI messages JSONL, or Parquet/Arrow/"
                                            "datasets rows) into .jsonl.packed rows.")
    p.add_argument("--input", nargs="+", required=True,
                   help="input JSONL file(s), read in order; also .parquet / .arrow files and datasets save_to_disk "
                        "folders (rows; needs the packsft[datasets] extra)")
    p.add_argument("--split", default=None, help="the split to read of a DatasetDict save_to_disk folder")
    p.add_argument("--output", required=True, help="output .jsonl.packed file")
    p.add_argument("--tokenizer", required=True, help="local tokenizer folder or tokenizer.json")
    p.add_argument("--max-seq-length", type=int, required=True, help="row length in tokens")
    p.add_argument("--prompt-format", default="chat-template", choices=PRESETS + ("default",))
    p.add_argument("--chat-template", default=None, help="Jinja template string or file (chat-template only)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None,
                   help="JSON object passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--train-on", default="all", choices=TRAIN_ON,
                   help="train all assistant turns, or only the last of each conversation")
    p.add_argument("--append-eos", default=None, action=argparse.BooleanOptionalAction,
                   help="append EOS to every trained assistant turn (default: when the template writes no end of "
                        "turn after it, and for passthrough)")
    p.add_argument("--pad-token", default=None, help="override the prompt format's pad token")
    p.add_argument("--context-parallel-size", type=positive_int, default=1)
    p.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="TP size of the training run; only used with --sequence-parallel")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="rows for Megatron sequence parallelism: max_seq_len a multiple of lcm(2*CP, CP*TP)")
    p.add_argument("--algorithm", default=DEFAULT_ALGORITHM, choices=ALGORITHMS,
                   help="bfd-local-search (default: best-fit decreasing, then rows emptied down to the lower bound "
                        "where it can), best-fit-decreasing, or next-fit (input order, NeMo RL's)")
    p.add_argument("--oversize", default="own-row", choices=OVERSIZE_POLICIES,
                   help="conversations longer than --max-seq-length: own row (truncated), drop, or error")
    p.add_argument("--max-conversation-bytes", type=int, default=MAX_CONVERSATION_BYTES,
                   help=f"reject input lines longer than this many bytes before parsing them (default "
                        f"{MAX_CONVERSATION_BYTES}, 4 MiB)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--shuffle-rows", action="store_true", help="write rows in a seeded random order")
    p.add_argument("--num-workers", type=int, default=0,
                   help="worker processes that read, tokenize and count shards of the input (0: this process)")
    p.add_argument("--engine", default="local", choices=ENGINES,
                   help="local: this machine (--num-workers processes); ray: Ray Data tasks on a Ray cluster "
                        "(packsft[ray] extra; --num-workers actors, default one per cluster CPU); same output")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to join with --engine ray (e.g. auto; default: $RAY_ADDRESS, else a local one)")
    p.add_argument("--shard-bytes", type=int, default=None,
                   help="input bytes per shard, a worker's unit of work (default: 1/64 of the input, 256 KiB-64 MiB, "
                        "the last 2 shards' worth cut in quarters); the output does not depend on it")
    p.add_argument("--format", dest="record_format", default="messages", choices=RECORD_FORMATS,
                   help="record shape: messages (OpenAI), input-output (with --input-key/--output-key), sharegpt "
                        "(conversations: [{from, value}]) or alpaca (instruction, input, output)")
    p.add_argument("--adapter", default=None, metavar="PKG.MODULE:FN",
                   help="a function turning one record into {'messages': [...], 'tools': [...]}, from PYTHONPATH")
    p.add_argument("--input-key", default=None, help="prompt field of prompt/response records")
    p.add_argument("--output-key", default=None, help="response field of prompt/response records")
    p.add_argument("--default-system-prompt", default="", help="system prompt for conversations without one")
    p.add_argument("--strict", action="store_true", help="stop at the first invalid record")
    p.add_argument("--allow-non-megatron", action="store_true",
                   help="Megatron presets: keep (and count) conversations Megatron-LM's SFTTokenizer refuses "
                        "instead of rejecting them; the file is then packsft-only")
    p.add_argument("--report", default=None, help="JSON report path (default <output>.report.json)")
    p.add_argument("--histogram", default=None, help="PNG path (default <output>.lengths.png; '' for none)")
    p.add_argument("--no-token-cache", action="store_true",
                   help="do not write <output>.tokens.npy / .tokens-index.npy (the loader then re-tokenizes)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return PackConfig(inputs=a.input, output=a.output, tokenizer=a.tokenizer, max_seq_len=a.max_seq_length,
                      prompt_format=a.prompt_format, chat_template=a.chat_template, pad_token=a.pad_token,
                      chat_template_kwargs=a.chat_template_kwargs, train_on=a.train_on, append_eos=a.append_eos,
                      context_parallel_size=a.context_parallel_size,
                      sequence_parallel_size=a.tensor_model_parallel_size if a.sequence_parallel else 1,
                      algorithm=a.algorithm, oversize=a.oversize,
                      seed=a.seed, shuffle_rows=a.shuffle_rows, num_workers=a.num_workers, input_key=a.input_key,
                      output_key=a.output_key, record_format=a.record_format, adapter=a.adapter,
                      default_system_prompt=a.default_system_prompt, strict=a.strict,
                      allow_non_megatron=a.allow_non_megatron,
                      report=a.report, histogram=a.histogram, progress=not a.no_progress,
                      max_conversation_bytes=a.max_conversation_bytes, token_cache=not a.no_token_cache,
                      shard_bytes=a.shard_bytes, split=a.split, engine=a.engine, ray_address=a.ray_address)


def main(argv=None) -> int:
    """Run the packer; return the process exit code."""
    cfg = parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            report = run_pack(cfg)
    except (ValueError, PackError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = Path(e.filename).resolve().parent if e.filename else " or ".join(output_folders(cfg))
        print(f"error: {e.strerror or 'no space left'} in {where} while packing {cfg.output}: free space there, or "
              "write the outputs (--output, --report, --histogram) to a larger disk; this run's temp files are removed "
              "and none of its outputs was published", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C: this run's temp files are already removed
        print(f"error: interrupted (SIGINT); {_stopped(e)}", file=sys.stderr)
        return 130
    except Terminated as e:  # SIGTERM: the same, and its exit code 143
        print(f"error: terminated (SIGTERM); {_stopped(e)}", file=sys.stderr)
        raise
    print(report.summary())
    return 0


def _stopped(e: BaseException) -> str:
    """What a stop signal left: the new outputs (it came while they were renamed into place), or no trace."""
    if getattr(e, "published", False):
        return "it came while the outputs were published: the new ones are complete and in place"
    return "this run's temp files are removed"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """The packer's warnings as ``warning: ...`` lines (not Python's ``file:line: PackWarning`` with a code line)."""
    if issubclass(category, PackWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


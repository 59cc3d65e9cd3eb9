"""Show one row of a packed file as the trainer sees it: conversations, roles, trained tokens, positions.

Examples::

    python tools/inspect_packed.py --packed data/train.jsonl.packed --tokenizer ../shared/data/tokenizers/qwen2.5 \
        --prompt-format chat-template --row 0
    python tools/inspect_packed.py --packed x.jsonl.packed --tokenizer tok/ --prompt-format nemotron-nano-v2 \
        --row 12 --max-seq-len 8192 --context-parallel-size 2 --color never | less

``--max-seq-len`` and ``--context-parallel-size`` default to the values in the file's sidecar
(``X.jsonl.packed.meta.json``); a sidecar that contradicts the options given is refused, as in training.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from packsft.config_rules import positive_int  # noqa: E402
from packsft.data.dataset import PackedSFTDataset  # noqa: E402
from packsft.data.describe import describe_row  # noqa: E402
from packsft.io import missing_file, os_error_text  # noqa: E402
from packsft.prompt_formats import PRESETS  # noqa: E402
from packsft.sidecar import read_sidecar, refuse_sidecar_as_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the dataset and print the row; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packed", required=True, help="the .jsonl.packed file")
    parser.add_argument("--tokenizer", required=True, help="tokenizer folder or tokenizer.json")
    parser.add_argument("--prompt-format", required=True, choices=PRESETS, help="the format the file was packed with")
    parser.add_argument("--row", type=int, default=0, help="row index, 0-based (negative: from the end)")
    parser.add_argument("--max-seq-len", "--max-seq-length", dest="max_seq_len", type=positive_int,
                        help="default: the sidecar's (--max-seq-length as the packer spells it)")
    parser.add_argument("--context-parallel-size", type=positive_int, help="default: the sidecar's, else 1")
    parser.add_argument("--pad-token", help="override the prompt format's pad token")
    parser.add_argument("--chat-template", help="chat-template only: a Jinja string or file")
    parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    args = parser.parse_args(argv)
    try:
        refuse_sidecar_as_rows(args.packed)
        meta = read_sidecar(args.packed) or {}
        max_seq_len = args.max_seq_len if args.max_seq_len is not None else meta.get("max_seq_len")
        if max_seq_len is None:
            if not Path(args.packed).is_file():
                raise missing_file("packed file", args.packed)
            parser.error("--max-seq-len is required when the packed file has no sidecar")
        cp = args.context_parallel_size if args.context_parallel_size is not None else \
            meta.get("context_parallel_size", 1)
        dataset = PackedSFTDataset(args.packed, args.tokenizer, args.prompt_format, max_seq_len, cp,
                                   pad_token=args.pad_token, chat_template=args.chat_template)
        color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        print(describe_row(dataset, args.row, color=color))
    except (ValueError, IndexError, FileNotFoundError) as e:  # SidecarError and ConversationError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                                        # a stray publish journal, an unreadable file
        print(f"error: {os_error_text(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

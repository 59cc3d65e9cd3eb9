#!/usr/bin/env python
"""Pack chat conversations (OpenAI ``messages`` JSONL) into ``.jsonl.packed`` rows for Megatron SFT.

One process, Qwen2.5 template, 4K rows::

    python tools/pack_megatron_sft_jsonl.py --input chats.jsonl --output out/rows.jsonl.packed \\
        --tokenizer path/to/qwen2.5 --prompt-format chat-template --max-seq-length 4096

For context parallelism 2, best-fit decreasing, 4 tokenizer processes, prompt/response records::

    python tools/pack_megatron_sft_jsonl.py --input a.jsonl b.jsonl --output out/rows.jsonl.packed \\
        --tokenizer tok/ --prompt-format nemotron-h-aligned --max-seq-length 8192 \\
        --context-parallel-size 2 --num-workers 4 --input-key prompt --output-key response

Writes the rows, ``<output>.meta.json`` (the sidecar the loader checks), ``<output>.report.json`` and
``<output>.lengths.png``; prints the report. Exit code 0 on success, 2 on bad settings or a stop
(``--strict`` / ``--oversize error``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

if __name__ == "__main__":
    try:  # Ctrl-C while the modules load: the same line and exit code as during the run
        from packsft.packing.cli import main
    except KeyboardInterrupt:
        print("error: interrupted (SIGINT) before the packer started", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())

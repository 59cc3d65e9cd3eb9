"""Report how ``data.backend: energon`` packs a split of an Energon dataset: rows, fill, text and image tokens.

    python tools/energon_report.py --config configs/tiny_llava_cpu.yaml
    python tools/energon_report.py --config configs/tiny_llava_cpu.yaml --split val --out report.json

Reads the training config (the same file and overrides as ``tools/train.py``), tokenizes every sample of the split
with the trainer's encoder (image tokens expanded by the processor of ``data.tokenizer``), packs them in packing
buffers of ``data.energon.buffer_size`` in the shards' order and prints the report as JSON (``--out``: also writes
it). Invalid samples stop it, or with ``data.energon.skip_invalid_samples`` are warned and counted as ``skipped``.
Exit status 2 with one ``error:`` line for a config or data error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, build the report, print (and write) it; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", required=True, help="training YAML file with data.backend: energon")
    parser.add_argument("--split", help="the split to report (default: data.split)")
    parser.add_argument("--out", help="also write the report to this JSON file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_seq_len=2048")
    args = parser.parse_args(argv)
    from packsft.io import atomic_open
    from packsft.train.config import load_config
    from packsft.train.data import energon_loader_module

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.data.backend != "energon":
            raise ValueError(f"{args.config}: data.backend is {cfg.data.backend!r}; this reports data.backend: "
                             "energon (a packed file's report is the packer's <output>.report.json)")
        energon_loader_module()   # names the packsft[energon] extra when megatron-energon is missing
        from packsft.train.energon_report import energon_report

        report = energon_report(cfg, args.split)
    except (ValueError, FileNotFoundError, ImportError) as err:   # config, data, a sample (EnergonSampleError)
        sys.stderr.write(f"error: {err}\n")
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with atomic_open(Path(args.out)) as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line of the packer (``tools/pack_megatron_sft_jsonl.py`` and the ``packsft-pack`` script).

See ``tools/pack_megatron_sft_jsonl.py`` for examples.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import sys
import warnings
from pathlib import Path

from packsft.packing.config import PackConfig, PackError, PackWarning, output_folders
from packsft.packing.pipeline import run_pack
from packsft.packing.signals import Terminated


def build_parser() -> argparse.ArgumentParser:
    """The packer's argument parser, generated from :class:`PackConfig`'s fields (their ``flags`` metadata, in field
    order; a flag's default is its field's)."""
    p = argparse.ArgumentParser(description="Pack chat conversations (OpenAI messages JSONL, or Parquet/Arrow/"
                                            "datasets rows) into .jsonl.packed rows.")
    for f in dataclasses.fields(PackConfig):
        for flag, kwargs in f.metadata["flags"]:
            if f.metadata["value"] is None:
                kwargs = {**kwargs, "default": f.default} if f.default is not dataclasses.MISSING else {
                    **kwargs, "required": True}
            p.add_argument(flag, **kwargs)
    return p


def parse_args(argv=None) -> PackConfig:
    """Parse the command line into a :class:`PackConfig`."""
    a = build_parser().parse_args(argv)
    values = {}
    for f in dataclasses.fields(PackConfig):
        flag, kwargs = f.metadata["flags"][0]
        value = f.metadata["value"]
        values[f.name] = value(a) if value else getattr(a, kwargs.get("dest") or flag[2:].replace("-", "_"))
    return PackConfig(**values)


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


"""Train a Megatron-Core GPT on packed SFT rows (``.jsonl.packed``), on CPU (gloo) or GPUs (NCCL).

One process (CPU or one GPU)::

    python tools/train.py --config configs/tiny_cpu.yaml

Two processes on one machine (data parallel, or ``parallel.context_parallel_size=2`` / TP=2)::

    torchrun --nproc_per_node=2 tools/train.py --config configs/tiny_cpu.yaml
    torchrun --nproc_per_node=2 tools/train.py --config configs/tiny_cpu.yaml parallel.context_parallel_size=2

Resume: ``checkpoint.resume=auto`` (the default) continues from ``<checkpoint dir>/latest`` when it exists, so
re-running the same command after an interruption resumes; ``checkpoint.resume=none`` starts over and
``checkpoint.resume=out/train/tiny_cpu/checkpoints/iter_0000010`` picks a checkpoint::

    python tools/train.py --config configs/tiny_cpu.yaml train.stop_at_step=10   # stop after step 10
    python tools/train.py --config configs/tiny_cpu.yaml                         # resumes at step 10

Arguments after ``--config`` are dotted overrides (``optimizer.lr=1e-3 train.global_batch_size=16``); every key is
described in docs/training.md. Outputs: ``<logging.output_dir>/metrics.jsonl``, ``tensorboard/``, ``config.yaml``
and ``checkpoints/``.

Preemption: SIGTERM or SIGINT (Ctrl-C) (``train.save_on_sigterm: true``, the default) finishes the current step,
writes a checkpoint and exits 0 (``stopped by SIGTERM after step N ...``); rerun the same command to resume. Loader
workers ignore both (the trainer decides). Signalled itself, stock torchrun forwards the signal and then exits 1 with
its own ``SignalException`` traceback; ``python -m packsft.train.launch`` (torchrun's arguments) forwards it and exits
0, also when Slurm signals every process of the job (a trainer under torchrun takes a repeated SIGTERM as the same
request). Under torchrun every worker dies with torchrun (``prctl(PR_SET_PDEATHSIG)``), and the checkpoint writer's
helper process dies with its trainer.

Trust: no file of a checkpoint (``checkpoint.resume``) or of ``checkpoint.init_from`` runs code when read: JSON,
``torch.load(weights_only=True)``, and torch's ``.metadata`` through an unpickler that admits only its own classes; a
file holding anything else is refused by name (docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``--config FILE`` plus any number of ``section.key=value`` overrides."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", required=True, help="YAML file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-3")
    return parser.parse_args(argv)


def error(text: str) -> None:
    """Print ``error: <text>`` as one write (under torchrun the ranks share stderr: a line is never split)."""
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """Load the config, train, tear down; return the exit status (2 on a config error)."""
    args = parse_args(argv)
    from packsft.train import process_guard  # standard library only: the stop signal is held from here on

    stop = process_guard.STOP_SIGNAL
    stop.install()                               # a stop signal during start-up is kept for the loop's first check
    stop.action = "stopping once the configuration is read (before the first step)"
    from packsft.train.compat import load_train_config
    from packsft.train.config import config_to_yaml

    try:
        cfg = load_train_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("LOCAL_RANK", "0") == "0":   # every rank of a machine reads the same files: one line
            error(str(err))
        return 2
    # from here on the run stops after a step and saves; without save_on_sigterm, once the trainer is built
    stop.action = stop.ACTION if cfg.train.save_on_sigterm else "stopping once the trainer is built"
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    from packsft.data.dataset import RowError
    from packsft.data.samplers import SamplerError
    from packsft.io import atomic_open, os_error_text
    from packsft.train.checkpoint import CheckpointWriteError
    from packsft.train.checkpoint_files import CheckpointSpaceError
    from packsft.train.distributed import destroy_distributed
    from packsft.train.loop import Trainer
    from packsft.train.model_checkpoint import unreadable_checkpoint_message

    if "TORCHELASTIC_RUN_ID" in os.environ:        # a torchrun worker: end with torchrun, even on its SIGKILL
        process_guard.die_with_parent()
    process_guard.forked_children_die_with_this_process()   # the checkpoint writer's forked processes
    try:
        try:
            trainer = Trainer(cfg)
        except (ValueError, FileNotFoundError, ImportError, CheckpointingException) as err:
            # layout, data, sidecar, vocabulary, resume (old format, another architecture), checkpoint.dir, an
            # optional dependency the config needs (TransformerEngine)
            error(str(err))
            return 2
        except OSError as err:                  # a file of the run that cannot be read (a stray publish journal, ...)
            error(os_error_text(err))
            return 2
        except CheckpointException as err:      # torch's reader: a truncated or missing .distcp (a BaseException)
            where = f"{err.checkpoint}: " if getattr(err, "checkpoint", None) else ""
            error(f"{where}{unreadable_checkpoint_message(err)}")
            return 2
        if trainer.ctx.rank == 0:
            with atomic_open(Path(cfg.logging.output_dir) / "config.yaml") as f:
                f.write(config_to_yaml(cfg))
        if not cfg.train.save_on_sigterm:         # the signals' defaults; one that came meanwhile ends the run now
            received = stop.received
            stop.uninstall()
            if received:
                print(f"stopped by {received} during start-up", file=sys.stderr)
                return 128 + getattr(signal, received)
        try:
            state = trainer.run()
        except CheckpointSpaceError as err:
            error(err.strerror)
            return 1
        except CheckpointWriteError as err:      # a dist_checkpointing writer process failed or died
            error(str(err))
            return 1
        except (RowError, SamplerError) as err:  # a row that does not tokenize (no sidecar); a sampler's bad index
            error(str(err))
            return 2
        if trainer.ctx.rank == 0:
            if trainer.stopped_by:
                saved = (f"checkpoint {trainer.last_checkpoint} written" if trainer.last_checkpoint
                         else "nothing new to save")
                print(f"stopped by {trainer.stopped_by} after step {state.step}: {saved}; rerun the same command to "
                      "resume")
            else:
                print(f"done: step {state.step}, {state.consumed_samples} rows, {state.trained_tokens} trained "
                      f"tokens; outputs in {cfg.logging.output_dir}")
    finally:
        destroy_distributed()
        process_guard.stop_checkpoint_writer()
    return 0


if __name__ == "__main__":  # required: dist_checkpointing.save starts a spawn-context Manager that re-imports this file
    sys.exit(main())

"""``torchrun`` whose stop signal stops the run cleanly: ``python -m packsft.train.launch`` takes torchrun's arguments.

Stock torchrun turns a SIGTERM or SIGINT it receives into a ``SignalException``: it forwards the signal to its workers,
waits for them (``--shutdown-timeout``), then re-raises, so it prints a traceback and exits 1 even when every trainer
saved its checkpoint and exited 0. This launcher is ``torch.distributed.run.main`` with one change: SIGTERM and SIGINT
are forwarded to the worker processes (each trainer, not its loader workers) and torchrun goes on watching them; when
they exit 0 after their save, it exits 0. A second signal is forwarded too (SIGINT twice ends the trainers at once;
under torchrun a trainer ignores a repeated SIGTERM, so that Slurm's SIGTERM to every process of the job, which the
trainers get once directly and once forwarded, still saves). SIGHUP and SIGQUIT keep torchrun's behaviour. A
trainer that fails (an ``error:`` line, a traceback) ends the launcher with its exit code and one line naming its rank,
without torchrun's ``ChildFailedError`` report::

    python -m packsft.train.launch --standalone --nproc-per-node 2 tools/train.py --config configs/tiny_cpu.yaml
"""

from __future__ import annotations

import os
import signal
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def forward_to_workers(signum: int, frame=None) -> None:
    """Signal handler of the launcher: send ``signum`` to every child process (the workers torchrun started)."""
    import psutil

    for child in psutil.Process().children():
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:       # ended meanwhile
            pass
    print(f"packsft.train.launch: {signal.Signals(signum).name} forwarded to the trainers", file=sys.stderr,
          flush=True)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun's ``main`` with :func:`forward_to_workers` as its handler of SIGTERM and SIGINT."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    torchrun_handler = api._terminate_process_handler   # looked up when torchrun registers its handlers

    def handler(signum: int, frame) -> None:
        if signum in FORWARDED:
            forward_to_workers(signum, frame)
        else:
            torchrun_handler(signum, frame)

    api._terminate_process_handler = handler
    try:
        torchrun_main(argv)
    except ChildFailedError as err:      # the trainers printed their own error lines: no second report
        rank, failure = err.get_first_failure()
        print(f"packsft.train.launch: trainer rank {rank} exited with {failure.exitcode}", file=sys.stderr,
              flush=True)
        sys.exit(failure.exitcode if failure.exitcode > 0 else 1)


if __name__ == "__main__":
    main()

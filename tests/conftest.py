"""Shared test fixtures: where the real inputs of ``../shared/data`` are."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# `examples` (samplers, demo scripts) is imported from the repository root; the test folders mirror packsft's
# packages and a test file may import another's fixtures by module name (`from test_loop import packed`).
for folder in (REPO_ROOT, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
# Each xdist process runs torch on one thread (and so do the processes tests start without their own setting): two
# processes of two OpenMP threads each on the 2-core CI machine spend most of their time waiting for each other
# (tests/model/test_gpt.py and the loss tests, two at once: 31 s, 7 s on one thread each).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
# A shell starts a background job (`cmd &` without job control) with SIGINT ignored, and an ignored signal stays
# ignored across exec: the Ctrl-C tests (KeyboardInterrupt here, exit 130 in the CLIs they start) would then see
# nothing. Python's own handler here is reset to the default in every child at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path of the shared real datasets and tokenizers.

    In CI (``CI=true``) a missing folder is a failure, not a skip: the real-data tests must run there.
    """
    if not SHARED_DATA.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"shared data not found at {SHARED_DATA} (set PACKSFT_SHARED_DATA)")
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tokenizer_dir(shared_data: Path):
    """Return a function mapping a tokenizer name (``qwen2.5``, ``smollm2-135m-instruct``, ...) to its folder."""
    return lambda name: shared_data / "tokenizers" / name


# The test files that take longest (seconds of one pytest process, 2-core machine shared with other jobs,
# 2026-12-07, after trainer and tool runs moved into forks of the fork server: distributed_helpers.tool_forked),
# longest first. `make test` runs files whole in 2 processes (`--dist loadfile --no-loadscope-reorder`), handing out
# files in collection order; starting with the longest keeps one long file from running alone at the end.
LONGEST_FIRST = (
    "test_preemption.py",               # 122 (its stopped and killed runs are real processes under torchrun)
    "test_plain_install.py",            # 100 (a fresh venv, then the tools)
    "test_vlm_train.py",                # 74
    "test_loop.py",                     # 62
    "test_pipeline.py",                 # 56
    "test_gpu_check.py",                # 52
    "test_publish.py",                  # 41
    "test_speed.py",                    # 36
    "test_energon_loader.py",           # 33
    "test_dataset.py",                  # 30
    "test_ray_engine.py",               # 30
    "test_bench_pack.py",               # 28
    "test_pipeline_parallel.py",        # 20
    "test_lora_run.py",                 # 20
    "test_parallel_parity.py",          # 20
    "test_checkpoint_writer.py",        # 20
    "test_hf_io_tp.py",                 # 20
    "test_hf_llava_convert.py",         # 19
    "test_memory.py",                   # 18
    "test_tools_errors.py",             # 18
    "test_gpu_variants.py",             # 18
    "test_convert_checkpoint_errors.py",  # 16
    "test_init_from.py",                # 14
    "test_token_cache.py",              # 14
    "test_distributed_optimizer.py",    # 13
    "test_hf_io_pp.py",                 # 13
    "test_megatron_golden.py",          # 13
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order

"""Shared test fixtures: where the real inputs of ``../shared/data`` are."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `examples` (samplers, demo scripts) is imported from the repository root
    sys.path.insert(0, str(REPO_ROOT))
SHARED_DATA = Path(os.environ.get("PACKSFT_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


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

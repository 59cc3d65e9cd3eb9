"""Optional dependencies: packsft's extras and the one import that names the extra a missing module needs."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"datasets": "datasets pyarrow", "energon": "megatron-energon", "ray": "ray[data]"}
"""``packsft[NAME]`` extra -> the packages it installs (``pyproject.toml``'s optional dependencies)."""


def import_extra(module: str, extra: str, needed_by: str, error: type[Exception] = ImportError) -> ModuleType:
    """``import module`` (dotted), part of the ``packsft[extra]`` extra.

    Raises:
        ``error``: the module cannot be imported: ``"{needed_by} needs the packsft[{extra}] extra: pip install
        'packsft[{extra}]' (or pip install PACKAGES); import {module} failed: REASON"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise error(f"{needed_by} needs the packsft[{extra}] extra: pip install 'packsft[{extra}]' (or pip install "
                    f"{EXTRAS[extra]}); import {module} failed: {err}") from err

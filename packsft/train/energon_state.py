"""A plain form of Energon's loader state (``save_state_rank()``) for packsft checkpoints: plain values and tensors
that ``torch.load(weights_only=True)`` reads, tagged so that :func:`from_plain` rebuilds Energon's own classes and
nothing else."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import numpy as np
import torch


def plain_state(value: Any) -> Any:
    """``value`` as plain values and tensors only, tagged so :func:`from_plain` rebuilds it: Energon's states hold
    dataclasses (``megatron.energon``'s), ``FlexState`` dicts, tuples, bytes and numpy arrays.

    Raises:
        TypeError: a value of another type (named).
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": torch.frombuffer(bytearray(value), dtype=torch.uint8).clone()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(value.astype(np.int64) if value.dtype.kind in "iu" else value.copy()),
                "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return {"__npscalar__": value.item(), "dtype": value.dtype.str}
    if isinstance(value, tuple):
        return {"__tuple__": [plain_state(v) for v in value]}
    if isinstance(value, list):
        return [plain_state(v) for v in value]
    if isinstance(value, dict):
        kind = type(value)
        return {"__dict__": f"{kind.__module__}:{kind.__qualname__}",
                "items": [[plain_state(k), plain_state(v)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value):
        kind = type(value)
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}",
                "fields": {f.name: plain_state(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"an Energon loader state holds a {type(value).__module__}.{type(value).__qualname__}, "
                    "which has no plain form")


def _energon_class(name: str) -> type:
    """The class ``module:qualname`` of a tagged state: ``dict``, or a dataclass or ``dict`` subclass that
    ``megatron.energon`` defines (nothing else is called: a planted state cannot name another callable)."""
    if name == "builtins:dict":
        return dict
    module, _, qualname = name.partition(":")
    found = getattr(importlib.import_module(module), qualname, None) if module.startswith("megatron.energon.") \
        and qualname.isidentifier() else None
    if not (isinstance(found, type) and found.__module__ == module
            and (dataclasses.is_dataclass(found) or issubclass(found, dict))):
        raise ValueError(f"an Energon loader state names the class {name}, not one of megatron.energon's")
    return found


def from_plain(value: Any) -> Any:
    """The value :func:`plain_state` made plain.

    Raises:
        ValueError: a tagged class that is not ``dict`` or ``megatron.energon``'s.
    """
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__bytes__" in value:
        return bytes(value["__bytes__"].tolist())
    if "__ndarray__" in value:
        return value["__ndarray__"].numpy().astype(np.dtype(value["dtype"]))
    if "__npscalar__" in value:
        return np.dtype(value["dtype"]).type(value["__npscalar__"])
    if "__tuple__" in value:
        return tuple(from_plain(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return _energon_class(value["__dict__"])((from_plain(k), from_plain(v)) for k, v in value["items"])
    if "__dataclass__" in value:
        return _energon_class(value["__dataclass__"])(**{k: from_plain(v) for k, v in value["fields"].items()})
    return {k: from_plain(v) for k, v in value.items()}

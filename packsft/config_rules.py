"""Declarative checks of packsft's config dataclasses (``ModelConfig``, the training config's sections,
``PackConfig``) and the one loader that builds them from YAML, JSON and dotted overrides.

A field declares its rules in its metadata, ``lr: float = field(default=3e-4, metadata=rules(*POSITIVE))``, and a
class the rules between its fields in a ``relations`` class attribute (:class:`Exclusive`, :class:`AnyOf`,
:func:`at_most`, :func:`multiple_of`, :class:`Needs`). :func:`check_fields`, called by ``__post_init__``
(``PackConfig.validate``), raises one ``ValueError`` for the first rule that fails:
``"<section>.<field> must be <rule>, got <value>"``, the field named by its ``name`` metadata where it has one
(``PackConfig``'s command-line flags). A field whose default is None may be None (its rules then read "... or
None"); OmegaConf's ``???`` (a value a later layer fills) is not checked.

:func:`build_config` merges OmegaConf layers over a dataclass schema and builds it; :func:`config_errors` turns
what goes wrong there (an unknown key, a value of the wrong type, invalid YAML, a failed check) into one
``ValueError`` line naming the source.
"""

from __future__ import annotations

import argparse
import math
import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, NamedTuple

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException


class Rule(NamedTuple):
    """A value passes when ``ok(value)`` is true; else it "must be ``text``"."""

    ok: Callable[[Any], bool]
    text: str


def gt(bound: float) -> Rule:
    """``value > bound``."""
    return Rule(lambda v: v > bound, f"> {bound}")


def ge(bound: float) -> Rule:
    """``value >= bound``."""
    return Rule(lambda v: v >= bound, f">= {bound}")


def in_range(lo: float, hi: float) -> Rule:
    """``lo <= value < hi``."""
    return Rule(lambda v: lo <= v < hi, f"in [{lo}, {hi})")


def one_of(choices) -> Rule:
    """``value in choices``."""
    choices = tuple(choices)
    return Rule(lambda v: v in choices, f"one of {choices}")


def distinct_names(choices) -> Rule:
    """A non-empty list of distinct names from ``choices``."""
    choices = tuple(choices)
    return Rule(lambda v: 0 < len(v) == len(set(v)) and set(v) <= set(choices),
                f"a non-empty list of distinct names from {choices}")


FINITE = Rule(lambda v: not isinstance(v, float) or math.isfinite(v), "a finite number")
POSITIVE = (FINITE, gt(0))
"""A finite number > 0 (NaN passes every comparison, so finiteness is checked first)."""
NON_NEGATIVE = (FINITE, ge(0))
FINITE_POSITIVE = Rule(lambda v: 0 < v < math.inf, "a finite number > 0")
POSITIVE_INT = Rule(lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer")
SEED = Rule(lambda v: 0 <= v < 2**63, "in [0, 2**63)")
"""What ``torch.manual_seed`` and numpy's generators take without overflow."""


def rules(*declared: Rule, **metadata: Any) -> dict[str, Any]:
    """A field's metadata declaring its rules, checked in order: ``field(default=0, metadata=rules(ge(0)))``."""
    return {**metadata, "rules": declared}


Condition = str | tuple[str, Any]
"""A field (holds when it is set: truthy), or ``(field, value)``: holds when the field equals ``value``, or passes
it when ``value`` is a :class:`Rule`. Fields are dotted paths from the checked object (``"optimizer.lr"``)."""


def _holds(condition: Condition, get) -> bool:
    if isinstance(condition, str):
        return bool(get(condition))
    key, want = condition
    return want.ok(get(key)) if isinstance(want, Rule) else get(key) == want


def _say(condition: Condition, name) -> str:
    if isinstance(condition, str):
        return name(condition)
    key, want = condition
    return f"{name(key)} {want.text if isinstance(want, Rule) else want}"


def _why(text: str, why: str) -> str:
    return f"{text}: {why}" if why else text


class Exclusive(NamedTuple):
    """Fields ``a`` and ``b`` are not both set (truthy)."""

    a: str
    b: str
    why: str = ""

    def failure(self, get, name) -> str | None:
        """The message when broken, else None (``get(key)``: a field's value, None for ``???``; ``name(key)``: how
        messages name the field)."""
        if get(self.a) and get(self.b):
            return _why(f"set either {name(self.a)} or {name(self.b)}, not both", self.why)
        return None


class AnyOf(NamedTuple):
    """At least one of the fields ``keys`` is set (truthy)."""

    keys: tuple[str, ...]
    why: str = ""

    def failure(self, get, name) -> str | None:
        """The message when broken, else None (as :meth:`Exclusive.failure`)."""
        if not any(get(key) for key in self.keys):
            return _why(f"{' or '.join(name(key) for key in self.keys)} is required", self.why)
        return None


class Compare(NamedTuple):
    """``holds(a, b)`` for fields ``a`` and ``b`` where both are set (not None); else ``a`` "must be ``says`` ``b``".
    """

    a: str
    b: str
    holds: Callable[[Any, Any], bool]
    says: str
    why: str = ""

    def failure(self, get, name) -> str | None:
        """The message when broken, else None (as :meth:`Exclusive.failure`)."""
        a, b = get(self.a), get(self.b)
        if a is not None and b is not None and not self.holds(a, b):
            return _why(f"{name(self.a)} ({a}) must be {self.says} {name(self.b)} ({b})", self.why)
        return None


def at_most(a: str, b: str, why: str = "") -> Compare:
    """``a <= b``."""
    return Compare(a, b, operator.le, "<=", why)


def multiple_of(a: str, b: str, why: str = "") -> Compare:
    """``a`` is a multiple of ``b`` (``b`` > 0: its field's rule)."""
    return Compare(a, b, lambda x, y: x % y == 0, "a multiple of", why)


class Needs(NamedTuple):
    """Where :data:`Condition` ``a`` holds, ``b`` holds too."""

    a: Condition
    b: Condition
    why: str = ""

    def failure(self, get, name) -> str | None:
        """The message when broken, else None (as :meth:`Exclusive.failure`)."""
        if _holds(self.a, get) and not _holds(self.b, get):
            got = get(self.b if isinstance(self.b, str) else self.b[0])
            return _why(f"{_say(self.a, name)} needs {_say(self.b, name)} (got {got!r})", self.why)
        return None


def _unset(value: Any) -> bool:
    """OmegaConf's ``???``: a schema default that a later layer fills."""
    return isinstance(value, str) and value == MISSING


def _failures(section: str, obj) -> Iterator[str]:
    """The messages of the rules ``obj`` breaks: its fields' in field order, then its class's ``relations``."""
    declared = {f.name: f for f in fields(obj)}

    def name(key: str) -> str:
        own = declared.get(key)
        if own is not None and "name" in own.metadata:
            return own.metadata["name"]
        return f"{section}.{key}" if section else key

    def get(key: str) -> Any:
        value = obj
        for part in key.split("."):   # None below a None section (data.energon=null)
            value = None if value is None else getattr(value, part)
        return None if _unset(value) else value

    for f in declared.values():
        value = getattr(obj, f.name)
        if _unset(value) or (value is None and f.default is None):
            continue
        failed = next((rule for rule in f.metadata.get("rules", ()) if not rule.ok(value)), None)
        if failed is not None:
            optional = " or None" if f.default is None else ""
            yield f"{name(f.name)} must be {failed.text}{optional}, got {value!r}"
    for relation in getattr(obj, "relations", ()):
        failure = relation.failure(get, name)
        if failure is not None:
            yield failure


def check_fields(section: str, obj) -> None:
    """Check the dataclass ``obj`` against its fields' ``rules`` metadata and its class's ``relations``.

    Args:
        section: the prefix of the dotted names in messages (``"optimizer"``; ``""``: the fields' own names).

    Raises:
        ValueError: the first rule that fails, naming the field(s) and value(s).
    """
    failure = next(_failures(section, obj), None)
    if failure is not None:
        raise ValueError(failure)


@contextmanager
def config_errors(where: str, cls: type | None = None) -> Iterator[None]:
    """Turn what goes wrong reading a config into one ``ValueError`` line, ``"<where>: <what>"``: OmegaConf's errors
    (the dotted key, then the first line of its message; a key that the dataclass ``cls`` itself lacks as
    ``unknown <cls> fields ['key']``), invalid YAML, and the ``ValueError`` of a check."""
    try:
        yield
    except OmegaConfBaseException as err:
        if isinstance(err, ConfigKeyError) and cls is not None and getattr(err, "object_type", None) is cls:
            what = f"unknown {cls.__name__} fields {[err.key]}"
        else:
            key, first = getattr(err, "full_key", None), (str(err).splitlines() or [type(err).__name__])[0]
            what = f"{key}: {first}" if key else first
        raise ValueError(f"{where}: {what}") from err
    except yaml.YAMLError as err:        # its own message spans lines: one is kept
        raise ValueError(f"{where}: not valid YAML: {' '.join(str(err).split())}") from err
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def build_config(cls, *layers, where: str, missing_hint: str | None = None):
    """The dataclass ``cls`` from ``layers`` (mappings, OmegaConf configs) merged in order over its schema; its
    ``__post_init__`` checks run as it is built (plain dataclasses, not OmegaConf nodes).

    Args:
        where: how messages name the source (a file, ``"<file> model section over <checkpoint>"``).
        missing_hint: a string: required fields that no layer gives are all listed, followed by it; None:
            OmegaConf's message names the first.

    Raises:
        ValueError: one line (:func:`config_errors`), e.g. ``"<where>: missing <cls> fields [...]<missing_hint>"``.
    """
    with config_errors(where, cls):
        merged = OmegaConf.merge(OmegaConf.structured(cls), *layers)
        missing = [f.name for f in fields(cls) if OmegaConf.is_missing(merged, f.name)]
        if missing and missing_hint is not None:
            raise ValueError(f"missing {cls.__name__} fields {missing}{missing_hint}")
        return OmegaConf.to_object(merged)


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (the tools' parallel sizes)."""
    value = int(text)   # argparse reports a ValueError as "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value

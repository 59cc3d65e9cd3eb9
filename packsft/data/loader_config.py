"""The loader's settings (:class:`DataLoaderConfig`, the ``loader`` section) and how a sampler is named: a built-in
or an import path checked once at config load (:func:`import_sampler_class`), its keyword arguments recorded in the
loader state by value and digest."""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from packsft.config_rules import SEED, Needs, check_fields, ge, one_of, rules
from packsft.data.balance import BALANCE_MODES
from packsft.data.samplers import BUILTIN_SAMPLERS, EpochSampler
from packsft.record_formats import import_named

SAMPLER_NAMES = (*BUILTIN_SAMPLERS, "custom")
REQUIRED_SAMPLER_METHODS = ("__iter__", "state_dict", "load_state_dict")


def import_sampler_class(path: str) -> type:
    """Import ``"pkg.module.Class"`` or ``"pkg.module:Class"`` and check it is a resumable sampler class.

    Raises:
        ValueError: if the path does not resolve, is not a class, or the class lacks ``__iter__``,
            ``state_dict`` or ``load_state_dict``; the message names ``sampler_class_path``.
    """
    obj = import_named(path, "sampler_class_path=", "pkg.module.ClassName", inspect.isclass, "a class")
    missing = [m for m in REQUIRED_SAMPLER_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(
            f"sampler_class_path={path!r}: class {obj.__name__} lacks {missing}; a sampler must define "
            "__iter__ (infinite) and state_dict/load_state_dict to be resumable"
        )
    return obj


def class_path(cls: type) -> str:
    """Return ``"module.QualName"`` of a class, as stored in the state header."""
    return f"{cls.__module__}.{cls.__qualname__}"


def plain_value(value: Any) -> Any:
    """Convert OmegaConf containers to plain dicts/lists; other values unchanged."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


@dataclass
class DataLoaderConfig:
    """Data loading section of the training config (OmegaConf-structured dataclass).

    Construction validates (``__post_init__``); after an OmegaConf merge call :meth:`validate`
    (``OmegaConf.to_object`` does it).
    """

    relations: ClassVar[tuple] = (
        Needs(("sampler", "custom"), "sampler_class_path", "e.g. 'examples.samplers.curriculum.CurriculumSampler'"),
        Needs("sampler_class_path", ("sampler", "custom"), "it is only used with sampler='custom'"),
    )

    sampler: str = field(default="random", metadata=rules(one_of(SAMPLER_NAMES)))
    """``random`` (seeded permutation per epoch), ``sequential`` (file order) or ``custom``."""
    sampler_class_path: str | None = None
    """Import path of the class when ``sampler: custom``: ``pkg.module.Class`` or ``pkg.module:Class``."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the sampler class (custom samplers only)."""
    num_workers: int = field(default=0, metadata=rules(ge(0)))
    """Worker processes (``spawn`` context when > 0); may change between save and resume."""
    persistent_workers: bool = False
    """Keep workers alive between iterators; ignored when ``num_workers == 0``."""
    seed: int = field(default=1234, metadata=rules(SEED))
    """Seed of the sampling order, identical on every data-parallel rank."""
    micro_batch_size: int = field(default=1, metadata=rules(ge(1)))
    """Rows per micro-batch on each data-parallel rank."""
    balance: str = field(default="none", metadata=rules(one_of(BALANCE_MODES)))
    """``none``: rank ``r`` trains rows ``r, r + dp, ...`` of each global batch; ``attention``: the rows of each
    global batch assigned to ranks and micro-batches so that their ``sum(s_i ** 2)`` is balanced
    (:mod:`packsft.data.balance`; needs a sampler that is an ``EpochSampler``)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (:func:`~packsft.config_rules.check_fields`) and resolve the sampler class.

        Raises:
            ValueError: naming the field and value: unknown ``sampler``, ``custom`` without (or a
                built-in with) ``sampler_class_path``, an unresolvable or non-sampler class,
                ``sampler_kwargs`` the class does not accept, negative workers, ``micro_batch_size < 1``, a ``seed``
                outside ``[0, 2**63)`` (numpy's ``SeedSequence`` and ``torch.Generator`` take no negative seed),
                an unknown ``balance``, or ``balance: attention`` with a sampler that is not an ``EpochSampler``.
        """
        check_fields("loader", self)
        cls = self.sampler_class()
        if self.balance != "none" and not issubclass(cls, EpochSampler):
            raise ValueError(f"loader.balance={self.balance!r} assigns the rows of each global batch to ranks: it "
                             f"needs a sampler of one global order (a packsft.data.samplers.EpochSampler), and "
                             f"{class_path(cls)} yields each rank's rows itself; use loader.balance=none")
        try:
            inspect.signature(cls).bind(0, dp_rank=0, dp_size=1, seed=self.seed, **plain_value(self.sampler_kwargs))
        except TypeError as exc:
            raise ValueError(
                f"sampler_kwargs={plain_value(self.sampler_kwargs)!r} do not fit {class_path(cls)}"
                f"{inspect.signature(cls)}: {exc}"
            ) from exc

    def sampler_class(self) -> type:
        """Return the sampler class named by ``sampler`` / ``sampler_class_path`` (see :meth:`validate`)."""
        if self.sampler == "custom":
            return import_sampler_class(self.sampler_class_path)
        return BUILTIN_SAMPLERS[self.sampler]


def recordable_kwargs(kwargs: dict[str, Any], limit: int = 4096) -> dict[str, Any] | None:
    """``kwargs`` as stored in the loader state header (plain JSON values), or None when they are not JSON or
    their JSON is over ``limit`` characters."""
    try:
        text = json.dumps(plain_value(kwargs), sort_keys=True)
    except (TypeError, ValueError):
        return None
    return json.loads(text) if len(text) <= limit else None


def kwargs_digest(kwargs: dict[str, Any]) -> str:
    """Return the sha256 of ``kwargs`` as canonical JSON (non-JSON values by ``repr``); stored in the header."""
    text = json.dumps(plain_value(kwargs), sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()

"""Curriculum sampler: easy rows first, then medium, then hard; random order within a stage.

Rows are ranked by a difficulty score (lower is easier; ties by row index) and cut into stages,
by default equal thirds. An epoch of a curriculum visits stage 0's rows in a random order, then
stage 1's, then stage 2's, so with ``stage_fractions=[1/3, 1/3, 1/3]`` the first third of the epoch's
steps trains on the easiest third of the rows. ``curriculum_epochs`` epochs follow the curriculum
(default: all); later epochs are plain random permutations of every row.

Config::

    sampler: custom
    sampler_class_path: examples.samplers.curriculum.CurriculumSampler
    sampler_kwargs: {difficulty_file: out/pack/difficulty.txt, curriculum_epochs: 1}

Difficulty sources, first one given wins: ``difficulties`` (one number per row), ``difficulty_file``
(a text file, one number per line, or a JSON list), else the number of trained tokens of each row
(``dataset[i]["loss_mask"].sum()``), which reads every row once at start-up.

Resumable: the order of an epoch is a pure function of ``(seed, epoch)`` and the stages, so the state is
the base class's ``(epoch, position)`` and a digest of the stages: a resume whose stages differ (the
``difficulty_file`` edited since, say) is refused, as its epoch would repeat some rows and skip others.
Every data-parallel rank trains its share of the same global batches of this order (see
``packsft.data.samplers``), so all ranks change stage at the same step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from packsft.data.samplers import EpochSampler, epoch_rng


def read_difficulties(path: str | Path) -> list[float]:
    """Read per-row difficulty scores: a JSON list, or one number per non-empty line.

    Raises:
        ValueError: naming the file and line of a value that is not a number.
    """
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return [float(v) for v in json.loads(text)]
    scores = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                scores.append(float(line))
            except ValueError:
                raise ValueError(f"{path}:{line_no}: difficulty {line.strip()!r} is not a number") from None
    return scores


def trained_tokens_per_row(dataset: Any) -> list[float]:
    """Return ``dataset[i]["loss_mask"].sum()`` for every row (float32 ``[L]`` mask -> trained tokens).

    Raises:
        TypeError: if ``dataset`` is a row count (no rows to read).
    """
    if isinstance(dataset, int):
        raise TypeError("CurriculumSampler needs the dataset (or difficulties/difficulty_file), not a row count")
    return [float(dataset[i]["loss_mask"].sum()) for i in range(len(dataset))]


def split_stages(scores: Sequence[float], stage_fractions: Sequence[float]) -> list[np.ndarray]:
    """Rank rows by ``(score, row index)`` and cut the ranking at cumulative ``stage_fractions``.

    Returns one int64 array of row indices per stage. Example: scores ``[5, 1, 3, 2, 4, 0]`` with
    thirds gives ``[[5, 1], [3, 2], [4, 0]]``.

    Raises:
        ValueError: if a fraction is not positive or a stage would get no row.
    """
    fractions = np.asarray(stage_fractions, dtype=np.float64)
    if len(fractions) == 0 or (fractions <= 0).any():
        raise ValueError(f"stage_fractions must be positive, got {list(stage_fractions)}")
    ranked = np.lexsort((np.arange(len(scores)), np.asarray(scores, dtype=np.float64)))
    cuts = np.rint(np.cumsum(fractions / fractions.sum()) * len(ranked)).astype(np.int64)
    stages = np.split(ranked, cuts[:-1])
    empty = [i for i, s in enumerate(stages) if len(s) == 0]
    if empty:
        raise ValueError(f"stages {empty} get no row: {len(ranked)} rows for stage_fractions {list(stage_fractions)}")
    return stages


class CurriculumSampler(EpochSampler):
    """Staged curriculum over difficulty-ranked rows; see the module docstring.

    Args:
        data_source: the dataset (or its row count when ``difficulties``/``difficulty_file`` is given).
        dp_rank, dp_size, seed: as for every sampler (``packsft.data.samplers``).
        difficulties: per-row scores, ``len == num_rows``; lower is easier.
        difficulty_file: path of per-row scores (see :func:`read_difficulties`).
        num_stages: equal stages when ``stage_fractions`` is not given.
        stage_fractions: share of the rows in each stage, easy first; normalised.
        curriculum_epochs: epochs that follow the curriculum; ``None`` means every epoch.

    Raises:
        ValueError: if the scores do not match the row count or a stage is empty.
    """

    def __init__(
        self,
        data_source: Any,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        *,
        difficulties: Sequence[float] | None = None,
        difficulty_file: str | None = None,
        num_stages: int = 3,
        stage_fractions: Sequence[float] | None = None,
        curriculum_epochs: int | None = None,
    ) -> None:
        super().__init__(data_source, dp_rank, dp_size, seed)
        if difficulties is None:
            difficulties = (
                read_difficulties(difficulty_file) if difficulty_file else trained_tokens_per_row(data_source)
            )
        if len(difficulties) != self.num_rows:
            raise ValueError(f"got {len(difficulties)} difficulties for {self.num_rows} rows")
        self.stages = split_stages(difficulties, stage_fractions or [1.0] * num_stages)
        self.curriculum_epochs = curriculum_epochs
        digest = hashlib.sha256()
        for stage in self.stages:
            digest.update(np.int64(len(stage)).tobytes() + stage.astype(np.int64).tobytes())
        self.stages_digest = digest.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """The base class's ``{"epoch", "position"}`` and ``"stages"``, a digest of the stages' rows."""
        return {**super().state_dict(), "stages": self.stages_digest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``.

        Raises:
            ValueError: the stages differ from the saved ones (other difficulties or fractions), or as the base
                class.
        """
        if state.get("stages", self.stages_digest) != self.stages_digest:
            raise ValueError("CurriculumSampler: the stages differ from the checkpoint's (the difficulty scores "
                             "or stage_fractions changed since, e.g. an edited difficulty_file): resumed, the epoch "
                             "would repeat some rows and skip others; restore them, or resume without the data "
                             "order (checkpoint.restore_data_order=false)")
        super().load_state_dict(state)

    def global_order(self, epoch: int) -> np.ndarray:
        """Return the stages' rows, each stage shuffled, easy first; a full shuffle after the curriculum."""
        rng = epoch_rng(self.seed, epoch)
        if self.curriculum_epochs is not None and epoch >= self.curriculum_epochs:
            return rng.permutation(self.num_rows)
        return np.concatenate([rng.permutation(stage) for stage in self.stages])

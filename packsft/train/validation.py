"""Validation of every validation set on the periods of the ``validation`` section (:class:`Validator`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from packsft.train.config_sections import ValidationConfig


class Validator:
    """Mean loss of each validation set (per token, or per conversation under ``loss.normalization:
    conversation``, as the training loss); the loop asks :meth:`at_start`, :meth:`should_validate` after each
    step and :meth:`at_end`.

    Args:
        cfg: the ``validation`` section.
        loaders: ``{name: loader}`` of this DP rank's rows (each pass is a new ``iter()``).
        chunks: the model chunks (``eval()`` during a pass).
        totals: ``[loss numerator, normaliser, trained tokens]`` fp64 ``[3]`` of a non-empty list of collated rows
            (one micro-batch each, at most ``micro_batches``), this rank's share (``Schedule.totals``: the
            normaliser counts trained tokens or conversations).
        reduce: the sum of a set's totals over the ranks (collective; called once per set on every rank), equal on
            every rank.
        micro_batches: rows per call of ``totals``.
        device: where the totals live.
    """

    def __init__(self, cfg: ValidationConfig, loaders: dict[str, Any], chunks: list[torch.nn.Module],
                 totals: Callable[[list[dict[str, Any]]], torch.Tensor],
                 reduce: Callable[[torch.Tensor], torch.Tensor], micro_batches: int, device: torch.device) -> None:
        self.cfg, self.loaders, self.chunks = cfg, loaders, chunks
        self.totals, self.reduce, self.micro_batches, self.device = totals, reduce, micro_batches, device
        self.validated_at: int | None = None

    def at_start(self, step: int) -> bool:
        """Whether to validate before the first step (``val_at_start``, a run that starts at step 0)."""
        return self.cfg.val_at_start and step == 0

    def should_validate(self, step: int) -> bool:
        """Whether ``validation.val_period`` falls on ``step``."""
        return bool(self.cfg.val_period) and step % self.cfg.val_period == 0

    def at_end(self, step: int) -> bool:
        """Whether to validate after the last step ``step`` (``val_at_end``, unless the period just did)."""
        return self.cfg.val_at_end and self.validated_at != step

    @torch.no_grad()
    def validate(self, step: int) -> dict[str, float]:
        """Mean loss of every validation set (all DP ranks; ``validation.max_batches`` per rank and set).

        Returns ``val_loss`` and ``val_trained_tokens`` over all sets together (weighted by tokens, or by
        conversations under ``loss.normalization: conversation``) and, per set, ``val_loss/<name>`` and
        ``val_trained_tokens/<name>``.
        """
        for chunk in self.chunks:
            chunk.eval()
        out, overall = {}, torch.zeros(3, dtype=torch.float64, device=self.device)
        for name, loader in self.loaders.items():
            totals = self.reduce(self._pass(loader))
            overall += totals
            out[f"val_loss/{name}"] = float(totals[0] / totals[1].clamp(min=1))
            out[f"val_trained_tokens/{name}"] = int(totals[2])
        for chunk in self.chunks:
            chunk.train()
        self.validated_at = step
        return {"val_loss": float(overall[0] / overall[1].clamp(min=1)), "val_trained_tokens": int(overall[2]),
                **out}

    def _pass(self, loader) -> torch.Tensor:
        """This rank's ``totals`` (fp64 ``[3]``) of one pass over ``loader``, ``micro_batches`` rows at a time."""
        limit, pending = self.cfg.max_batches, []
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i, row in enumerate(loader):
            if limit is not None and i >= limit:
                break
            pending.append(row)
            if len(pending) == self.micro_batches:
                totals += self.totals(pending)
                pending = []
        if pending:
            totals += self.totals(pending)
        return totals

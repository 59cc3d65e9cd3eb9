"""This rank's model chunks through Megatron-Core's forward-backward schedule (``get_forward_backward_func``: no
pipelining, 1F1B, or interleaved 1F1B with virtual stages), for training steps and validation alike.

Every stage gets each micro-batch's packed-sequence parameters (``cu_seqlens``, ``max_seqlen``), so attention stays
inside each conversation on every stage; the last stage computes the per-token loss (``gpt_token_loss``: the chunked
fused linear cross-entropy, ``loss.fused_linear_cross_entropy``) and the totals are broadcast from it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from packsft.layout import IGNORE_INDEX
from packsft.loss import normalize_loss
from packsft.model.gpt import unwrap_model
from packsft.train.config import Config
from packsft.train.data import model_input
from packsft.train.distributed import DistributedContext
from packsft.train.token_loss import gpt_token_loss, model_logits


class Schedule:
    """Runs micro-batches through ``chunks`` (this rank's model chunks, each in Megatron's DDP) by Megatron-Core's
    schedule; ``cfg`` gives ``data.max_seq_len``, ``loader.micro_batch_size``, ``loss`` and ``train.autocast_dtype``."""

    def __init__(self, chunks: list[torch.nn.Module], cfg: Config, ctx: DistributedContext) -> None:
        self.chunks, self.cfg, self.ctx = chunks, cfg, ctx

    def _autocast(self):
        """``torch.autocast`` to ``train.autocast_dtype`` (CUDA), else nothing."""
        dtype = self.cfg.train.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=getattr(torch, dtype))

    def stage_forward(self, model: torch.nn.Module, batch: dict[str, Any], logits: bool = False) -> torch.Tensor:
        """One model chunk on one micro-batch, with the row's packed-sequence parameters on every stage.

        Returns: before the last stage, the hidden states ``[t, 1, h]`` sent to the next stage; on the last stage
        the per-token loss fp32 ``[t]`` (``gpt_token_loss``), or with ``logits`` the logits ``[1, t, v / tp]``. A
        LLaVA model (one stage) takes the micro-batch's ``images`` too (``token_loss.model_logits``).
        """
        with self._autocast():
            if not unwrap_model(model).post_process:
                return model(batch["tokens"], batch["position_ids"], None, packed_seq_params=batch["packed_seq_params"])
            return model_logits(model, batch) if logits else self.token_losses(model, batch)

    def token_losses(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The last stage's per-token loss, fp32 ``[t]`` (``gpt_token_loss`` with the ``loss`` settings)."""
        per_token, _ = gpt_token_loss(model, batch, fused=self.cfg.loss.fused_linear_cross_entropy,
                                      chunk_size=self.cfg.loss.chunk_size)
        return per_token

    def run(self, batches: list[dict[str, Any]], count: torch.Tensor | None = None, *, forward_only: bool = False,
            logits: bool = False) -> list[dict[str, torch.Tensor]]:
        """Run ``batches`` (this rank's micro-batches, model inputs) through Megatron-Core's schedule
        (``get_forward_backward_func``: no pipelining, 1F1B, or interleaved 1F1B with virtual stages).

        Training (``forward_only`` False): each micro-batch back-propagates ``sum(token loss) / count``; gradients
        accumulate in ``main_grad`` (no reduction). ``count`` (int64 scalar) is the global trained-token count, or
        under ``loss.normalization: conversation`` the global conversation count, and the sum is weighted by the
        batch's ``loss_weight`` (``model_input``). Forward only: no backward (validation, or ``logits`` to read the
        last stage's logits).

        Returns:
            On the last stage one dict per micro-batch: ``loss_sum`` (fp32 scalar, the token-loss sum) and
            ``trained_tokens`` (int64 scalar), under ``conversation`` also ``conversation_loss_sum`` (fp32 scalar,
            the ``loss_weight``-weighted sum) and ``conversations`` (int64 scalar); or ``logits``
            (``[1, t, v / tp]``); ``[]`` on other stages.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        per_conversation = self.cfg.loss.normalization == "conversation"

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = self.stage_forward(model, batch, logits=logits)
            if not unwrap_model(model).post_process:
                return output, None
            trained = torch.tensor(batch["trained_index"].numel(), dtype=torch.int, device=self.ctx.device)
            if logits:
                return output, lambda out: (out.sum(), trained, {"logits": out.detach()})
            loss_sum = output.sum()
            reduced = {"loss_sum": loss_sum.detach().float(), "trained_tokens": trained.long()}
            if per_conversation:
                loss_sum = (output * batch["loss_weight"].reshape(-1)).sum()
                reduced.update(conversation_loss_sum=loss_sum.detach().float(), conversations=batch["conversations"])
            loss = loss_sum if count is None else normalize_loss(loss_sum, count, 1)
            return loss, lambda out: (out, trained, reduced)

        seq_length = self.cfg.loader.micro_batch_size * self.cfg.data.max_seq_len
        iterators = [iter(batches) for _ in self.chunks]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.chunks, num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=1,
            forward_only=forward_only)

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of the last pipeline stage, broadcast to every stage of this pipeline (in place)."""
        if self.ctx.pipeline_model_parallel_size > 1:
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=self.ctx.pp_group)
        return tensor

    def totals(self, rows: list[dict[str, Any]]) -> torch.Tensor:
        """``[loss numerator, normaliser, trained tokens]`` (fp64) of collated ``rows`` (one micro-batch each) by the
        forward-only schedule (zeros before the last stage): ``[loss sum, trained tokens, trained tokens]``, or
        under ``loss.normalization: conversation`` ``[conversation loss sum, conversations, trained tokens]``
        (each conversation's mean loss summed, see :meth:`run`).

        The interleaved schedule (virtual stages) runs only a multiple of ``P`` micro-batches (its groups of ``P``
        contiguous micro-batches per chunk): a last group of fewer rows is filled with copies of its first row
        that train no token (labels ``IGNORE_INDEX``, loss mask 0, no conversation), which add exactly 0 to the
        totals.
        """
        ctx, mode = self.ctx, self.cfg.loss.normalization
        batches = [model_input(row, ctx.context_parallel_size, ctx.cp_rank, ctx.cp_group, ctx.device, mode)
                   for row in rows]
        pp = ctx.pipeline_model_parallel_size
        if ctx.virtual_pipeline_model_parallel_size is not None and len(batches) % pp:
            filler = {**batches[0], "labels": torch.full_like(batches[0]["labels"], IGNORE_INDEX),
                      "loss_mask": torch.zeros_like(batches[0]["loss_mask"]),
                      "trained_index": batches[0]["trained_index"][:0]}
            if mode == "conversation":
                filler.update(loss_weight=torch.zeros_like(filler["loss_weight"]),
                              conversations=torch.zeros_like(filler["conversations"]))
            batches = [*batches, *[filler] * (pp - len(batches) % pp)]
        numerator, normaliser = (("conversation_loss_sum", "conversations") if mode == "conversation"
                                 else ("loss_sum", "trained_tokens"))
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for out in self.run(batches, forward_only=True):
            totals += torch.stack([out[numerator].double(), out[normaliser].double(), out["trained_tokens"].double()])
        return totals

    def reduce_totals(self, totals: torch.Tensor) -> torch.Tensor:
        """``totals`` summed over DP x CP and broadcast from the last pipeline stage (in place)."""
        dist.all_reduce(totals, group=self.ctx.dp_cp_group)
        return self.from_last_stage(totals)

"""Per-token loss of one packed row: the trainer's choice between the fused and the stock loss.

* fused (``loss.fused_linear_cross_entropy: true``): final hidden states ``[t, h]`` and the (vocab-parallel)
  output weight go to :func:`packsft.loss.fused_linear_cross_entropy`, which never materialises ``[t, v]``
  logits (``docs/loss.md``);
* stock: ``labels=`` given to ``GPTModel`` -> Megatron's ``tensor_parallel.vocab_parallel_cross_entropy``.

A LLaVA model (a micro-batch with ``images``) takes the same path: its hidden states or logits come from
:func:`packsft.model.vlm.llava_hidden_states` / :func:`~packsft.model.vlm.llava_logits` (expanded coordinates, as
the row's labels), its output weight and TP group from its ``language_model``; the stock loss is Megatron's
``vocab_parallel_cross_entropy`` on its logits.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch import Tensor

from packsft.layout import IGNORE_INDEX
from packsft.loss import fused_linear_cross_entropy
from packsft.model.output_head import final_hidden_states, output_weight
from packsft.model.vlm import language_model, llava_hidden_states, llava_logits


def model_logits(model, batch: dict) -> Tensor:
    """The logits ``[1, t, v / tp]`` of one packed row (``batch`` as :func:`gpt_token_loss`'s; with ``images``
    float ``[n, 3, H, W]`` through a LLaVA model)."""
    psp = batch["packed_seq_params"]
    if "images" in batch:
        return llava_logits(model, batch["images"], batch["tokens"], psp)
    return model(batch["tokens"], batch["position_ids"], None, packed_seq_params=psp)


def gpt_token_loss(model, batch: dict, *, fused: bool, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Run ``model`` on one packed THD row and return its per-token cross-entropy.

    Args:
        model: ``GPTModel`` (or a wrapper with ``.module``, called as is so DDP hooks run); for
            ``fused=True`` prepared with ``packsft.model.output_head.use_hidden_state_output``. Or a LLaVA model
            (``packsft.model.vlm.build_llava_model``, wrapped or not) when ``batch`` holds ``images``.
        batch: ``tokens`` int64 ``[1, t]``, ``position_ids`` int64 ``[1, t]``, ``labels`` int64
            ``[1, t]`` (``IGNORE_INDEX`` = untrained), ``loss_mask`` float ``[1, t]``, ``packed_seq_params``
            (``PackedSeqParams``, ``qkv_format="thd"``, global ``cu_seqlens``). Under context
            parallelism ``t`` is this rank's share, already sliced. For a LLaVA model also ``images`` (float
            ``[n, 3, H, W]``, the row's images in order) with ``image_seq_length`` image ids per image in
            ``tokens``.
        fused: True -> the fused loss on the hidden states (``reduction="none"``, vocab-parallel over the
            model's TP group); False -> Megatron's ``vocab_parallel_cross_entropy`` through
            ``GPTModel(labels=...)``.
        chunk_size: tokens per chunk of the fused loss (ignored by the stock path).

    Returns:
        ``(per_token_loss, loss_mask)``, both fp32 ``[t]``. ``loss_mask`` is the input mask, zeroed
        where ``labels == IGNORE_INDEX``; ``per_token_loss`` (nats) is already multiplied by it, so
        untrained tokens are exactly 0. The training loss is ``per_token_loss.sum()`` divided by the
        global number of trained tokens (``packsft.loss.normalize_loss``).
    """
    tokens, labels = batch["tokens"], batch["labels"]
    loss_mask = (batch["loss_mask"].float() * (labels != IGNORE_INDEX)).reshape(-1)
    psp = batch["packed_seq_params"]
    safe_labels = labels.masked_fill(labels == IGNORE_INDEX, 0)
    if not fused and "images" in batch:     # GPTModel's compute_language_model_loss on the LLaVA logits
        logits = llava_logits(model, batch["images"], tokens, psp)                  # [1, t, v / tp]
        per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).float(), safe_labels.transpose(0, 1))
        return per_token.reshape(-1) * loss_mask, loss_mask
    if not fused:
        per_token = model(tokens, batch["position_ids"], None, labels=safe_labels,
                          packed_seq_params=psp).reshape(-1).float()
        return per_token * loss_mask, loss_mask
    if "images" in batch:                   # [1, t, h], after the final norm
        hidden = llava_hidden_states(model, batch["images"], tokens, psp)
    else:
        hidden = final_hidden_states(model, tokens, batch["position_ids"], psp)
    gpt = language_model(model)
    weight = output_weight(gpt)
    hidden = hidden.to(weight.dtype)     # Megatron's Float16Module returns bf16 outputs upcast to fp32: exact
    per_token = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), loss_mask,
        chunk_size=chunk_size, reduction="none", tp_group=gpt.pg_collection.tp,
        # under SP the hidden states' all-gather reduce-scatters (sums) their gradient over TP itself
        reduce_hidden_grad=not gpt.config.sequence_parallel, trained_index=batch.get("trained_index"),
    )
    return per_token, loss_mask

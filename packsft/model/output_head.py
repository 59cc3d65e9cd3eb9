"""The one seam between Megatron's ``GPTModel`` and packsft's loss: final hidden states instead of logits.

megatron-core 0.16.1 has no public way to get the post-final-norm hidden states out of ``GPTModel``
(only the private ``GPTModel._postprocess``; later versions add an ``output_processor`` hook,
Megatron-LM PR #4686). packsft therefore swaps the class of ``model.output_layer`` to
:class:`HiddenStateOutputLayer`, a ``ColumnParallelLinear`` subclass that can return its input. The
weight, its initialisation, its tensor-parallel sharding and ``sharded_state_dict`` keys are those
of the stock layer, so checkpoints are interchangeable with a stock ``GPTModel``. When upgrading
Megatron-Core, only this file should change.

Both loss paths live on the same model object, chosen per call by :func:`gpt_token_loss`
(trainer config ``loss.fused_linear_cross_entropy: true|false`` and ``loss.chunk_size``):

* fused: hidden ``[t, h]`` -> :func:`packsft.loss.fused_linear_cross_entropy` (chunked, never
  materialises ``[t, v]`` logits);
* stock: ``labels=`` given to ``GPTModel`` -> logits ``[t, 1, v/tp]`` ->
  ``tensor_parallel.vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

from contextlib import contextmanager

from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import Tensor

IGNORE_INDEX = -100


class HiddenStateOutputLayer(ColumnParallelLinear):
    """``ColumnParallelLinear`` that returns its input ``[s, b, h]`` unchanged while ``return_hidden_states``.

    Installed by :func:`use_hidden_state_output` through a class swap, so parameters and
    ``sharded_state_dict`` are untouched. With ``return_hidden_states`` False (the default) it is the
    stock layer.
    """

    return_hidden_states: bool = False

    def forward(self, input_: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """Return ``(input_, None)`` while ``return_hidden_states``, else the stock ``(logits, bias)``."""
        if self.return_hidden_states:
            return input_, None
        return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)


def _unwrap(model):
    """The ``GPTModel`` inside a DDP-style wrapper (``.module``), or the model itself."""
    while hasattr(model, "module"):
        model = model.module
    return model


def use_hidden_state_output(model) -> None:
    """Let ``model`` (a ``GPTModel`` or a wrapper with ``.module``) return final hidden states on demand.

    Idempotent. Changes no parameter, buffer or checkpoint key; the model keeps returning logits/loss
    until :func:`gpt_token_loss` asks for hidden states.

    Raises:
        ValueError: if the model has no ``ColumnParallelLinear`` ``output_layer`` (e.g. not the last
            pipeline stage).
    """
    gpt = _unwrap(model)
    layer = getattr(gpt, "output_layer", None)
    if not isinstance(layer, ColumnParallelLinear):
        raise ValueError(f"model.output_layer must be a ColumnParallelLinear, got {type(layer).__name__}")
    if not isinstance(layer, HiddenStateOutputLayer):
        layer.__class__ = HiddenStateOutputLayer
        layer.return_hidden_states = False


@contextmanager
def _hidden_states_mode(layer: HiddenStateOutputLayer):
    layer.return_hidden_states = True
    try:
        yield
    finally:
        layer.return_hidden_states = False


def output_weight(model) -> Tensor:
    """The output weight ``[v/tp, h]``: the tied word embedding, or ``output_layer.weight``."""
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def gpt_token_loss(model, batch: dict, *, fused: bool, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Run ``model`` on one packed THD row and return its per-token cross-entropy.

    Args:
        model: ``GPTModel`` (or a wrapper with ``.module``, called as is so DDP hooks run); for
            ``fused=True`` prepared with :func:`use_hidden_state_output`.
        batch: ``tokens`` int64 ``[1, t]``, ``position_ids`` int64 ``[1, t]``, ``labels`` int64
            ``[1, t]`` (-100 = untrained), ``loss_mask`` float ``[1, t]``, ``packed_seq_params``
            (``PackedSeqParams``, ``qkv_format="thd"``, global ``cu_seqlens``). Under context
            parallelism ``t`` is this rank's share, already sliced.
        fused: True -> :func:`packsft.loss.fused_linear_cross_entropy` on the hidden states
            (``reduction="none"``, vocab-parallel over the model's TP group); False -> Megatron's
            ``vocab_parallel_cross_entropy`` through ``GPTModel(labels=...)``.
        chunk_size: tokens per chunk of the fused loss (ignored by the stock path).

    Returns:
        ``(per_token_loss, loss_mask)``, both fp32 ``[t]``. ``loss_mask`` is the input mask, zeroed
        where ``labels == -100``; ``per_token_loss`` (natural-log units, nats) is already multiplied
        by it, so untrained tokens are exactly 0. The training loss is ``per_token_loss.sum()``
        divided by the global number of trained tokens (DESIGN §7).

    Raises:
        ValueError: ``fused=True`` on a model without :func:`use_hidden_state_output`, or a batch
            that is not one row.
    """
    tokens, labels = batch["tokens"], batch["labels"]
    if tokens.dim() != 2 or tokens.shape[0] != 1 or labels.shape != tokens.shape:
        raise ValueError(f"expected tokens and labels of shape [1, t] (one THD row), got "
                         f"{tuple(tokens.shape)} and {tuple(labels.shape)}")
    loss_mask = (batch["loss_mask"].float() * (labels != IGNORE_INDEX)).reshape(-1)
    args = (tokens, batch["position_ids"], None)
    psp = batch["packed_seq_params"]
    if not fused:
        safe_labels = labels.masked_fill(labels == IGNORE_INDEX, 0)
        per_token = model(*args, labels=safe_labels, packed_seq_params=psp).reshape(-1).float()
        return per_token * loss_mask, loss_mask
    from packsft.loss import fused_linear_cross_entropy

    gpt = _unwrap(model)
    if not isinstance(gpt.output_layer, HiddenStateOutputLayer):
        raise ValueError("fused loss needs packsft.model.output_head.use_hidden_state_output(model) first")
    with _hidden_states_mode(gpt.output_layer):
        hidden = model(*args, packed_seq_params=psp)              # [1, t, h], after the final norm
    per_token = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), output_weight(gpt), labels.reshape(-1), loss_mask,
        chunk_size=chunk_size, reduction="none", tp_group=gpt.pg_collection.tp,
    )
    return per_token, loss_mask

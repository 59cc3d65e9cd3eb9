"""The one seam between Megatron's ``GPTModel`` and packsft's loss: final hidden states instead of logits.

megatron-core 0.16 has no public way to get the post-final-norm hidden states out of ``GPTModel`` (later
versions add an ``output_processor`` hook, Megatron-LM PR #4686). packsft swaps the class of
``model.output_layer`` to :class:`HiddenStateOutputLayer`, a ``ColumnParallelLinear`` subclass that can return
its input; weight, initialisation, TP sharding and ``sharded_state_dict`` keys stay the stock layer's, so
checkpoints are interchangeable with a stock ``GPTModel``. When upgrading megatron-core, only this file should
change. Which loss runs on these hidden states is the trainer's choice (``packsft.train.token_loss``).
"""

from __future__ import annotations

from contextlib import contextmanager

from megatron.core.tensor_parallel import ColumnParallelLinear, gather_from_sequence_parallel_region
from torch import Tensor

from packsft.model.gpt import unwrap_model


class HiddenStateOutputLayer(ColumnParallelLinear):
    """``ColumnParallelLinear`` that returns its input ``[s, b, h]`` unchanged while ``return_hidden_states``.

    Installed by :func:`use_hidden_state_output` through a class swap, so parameters and
    ``sharded_state_dict`` are untouched. With ``return_hidden_states`` False (the default) it is the
    stock layer.
    """

    return_hidden_states: bool = False

    def forward(self, input_: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None):
        """Return ``(input_, None)`` while ``return_hidden_states``, else the stock ``(logits, bias)``.

        Under sequence parallelism ``input_`` is this rank's ``[s / tp, b, h]`` shard; it is all-gathered to
        ``[s, b, h]`` first (backward: reduce-scatter, summing every TP rank's partial gradient), as the stock
        layer does before its matmul, so the loss sees every token on every TP rank.
        """
        if self.return_hidden_states:
            if self.sequence_parallel:
                input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                              group=self.tp_group)
            return input_, None
        return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)


def use_hidden_state_output(model) -> None:
    """Let ``model`` (a ``GPTModel`` or a wrapper with ``.module``) return final hidden states on demand.

    Idempotent. Changes no parameter, buffer or checkpoint key; the model keeps returning logits/loss
    until :func:`gpt_token_loss` asks for hidden states. Only the last pipeline stage has an ``output_layer``
    (Megatron's ``ColumnParallelLinear``).
    """
    layer = unwrap_model(model).output_layer
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
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def final_hidden_states(model, tokens: Tensor, position_ids: Tensor, packed_seq_params) -> Tensor:
    """Run ``model`` and return its post-final-norm hidden states instead of logits.

    Args:
        model: a ``GPTModel`` prepared with :func:`use_hidden_state_output`, or its wrapper (called as is so
            DDP hooks run).
        tokens, position_ids: int64 ``[1, t]`` (one THD row, this CP rank's share).
        packed_seq_params: ``PackedSeqParams`` (``qkv_format="thd"``).

    Returns:
        ``[1, t, h]`` in the model's activation dtype.
    """
    with _hidden_states_mode(unwrap_model(model).output_layer):
        return model(tokens, position_ids, None, packed_seq_params=packed_seq_params)

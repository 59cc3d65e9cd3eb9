"""Chunked fused linear cross-entropy (TP vocab-parallel, CP-safe) and global-batch loss normalisation (per token
or per conversation)."""

from packsft.loss.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyFunction,
    fused_linear_cross_entropy,
)
from packsft.loss.normalization import (
    conversation_weights,
    global_num_trained_conversations,
    global_num_trained_tokens,
    normalize_loss,
    num_trained_tokens,
)

__all__ = [
    "FusedLinearCrossEntropyFunction",
    "conversation_weights",
    "fused_linear_cross_entropy",
    "global_num_trained_conversations",
    "global_num_trained_tokens",
    "normalize_loss",
    "num_trained_tokens",
]

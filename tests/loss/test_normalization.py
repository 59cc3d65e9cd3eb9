"""Per-conversation loss weights and counts (``loss.normalization: conversation``) on hand-made packed rows."""

import torch

from packsft.data.collate import collate_rows
from packsft.data.row import build_row
from packsft.layout import IGNORE_INDEX, cp_partition_indices
from packsft.loss import conversation_weights, global_num_trained_conversations, normalize_loss

IG = IGNORE_INDEX


def test_each_trained_conversation_weighs_one_split_over_its_trained_tokens():
    # segments [0, 4) with 3 trained tokens, [4, 6) with none, [6, 10) with 1 (+ tail position 10, untrained)
    labels = torch.tensor([[5, 6, 7, IG, IG, IG, 8, IG, IG, IG, IG]])
    loss_mask = (labels != IG).float()
    loss_mask[0, 1] = 0.0                                   # masked although labelled: not trained
    labels[0, 3], loss_mask[0, 3] = 9, 1.0                  # labelled, mask 1: trained
    weights, conversations = conversation_weights(loss_mask, labels, torch.tensor([0, 4, 6, 10], dtype=torch.int32))
    third = torch.tensor(1.0 / 3.0, dtype=torch.float32).item()
    assert weights.shape == labels.shape and weights.dtype == torch.float32
    assert weights[0].tolist() == [third, 0.0, third, third, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert conversations.dtype == torch.int64 and int(conversations) == 2       # the untrained one is not counted


def test_tail_positions_belong_to_the_last_segment():
    labels = torch.tensor([IG, 4, IG, 5, 6])                  # offsets end at 3: positions 3, 4 are the last segment's
    weights, conversations = conversation_weights((labels != IG).float(), labels, torch.tensor([0, 2, 3]))
    assert weights.tolist() == [0.0, 1.0, 0.0, 0.5, 0.5] and int(conversations) == 2


def test_cp_slices_of_the_weights_keep_the_whole_conversation_count():
    """Weights computed on the whole row, then sliced per CP rank: each conversation still sums to 1 over ranks."""
    row, _ = build_row([([1, 2, 3, 4, 5], [IG, 2, 3, 4, 5]), ([6, 7, 8], [IG, IG, 8])], pad_id=0, max_seq_len=16,
                       context_parallel_size=2)
    batch = collate_rows([row])
    weights, conversations = conversation_weights(batch["loss_mask"], batch["labels"], batch["cu_seqlens_padded"])
    assert int(conversations) == 2
    per_rank = [weights.index_select(-1, cp_partition_indices(batch["cu_seqlens_padded"], 2, r)) for r in (0, 1)]
    assert all(0 < float(w.sum()) < 2 for w in per_rank)    # both ranks hold a part of a conversation
    assert abs(sum(float(w.sum()) for w in per_rank) - 2.0) < 1e-6


def test_global_count_and_normalized_sum_are_the_mean_of_conversation_means():
    losses = torch.tensor([1.0, 2.0, 3.0, 0.0, 10.0], requires_grad=True)     # conversations [0, 3) and [3, 5)
    labels = torch.tensor([1, 1, 1, IG, 1])
    weights, count = conversation_weights((labels != IG).float(), labels, torch.tensor([0, 3, 5]))
    total = global_num_trained_conversations([count, torch.tensor(1)], groups=None)    # a second micro-batch's 1
    assert int(total) == 3
    normalize_loss((losses * weights).sum(), total).backward()
    assert abs(float((losses * weights).sum()) - (2.0 + 10.0)) < 1e-6
    assert torch.allclose(losses.grad, torch.tensor([1 / 9, 1 / 9, 1 / 9, 0.0, 1 / 3]))
    assert int(global_num_trained_conversations([], groups=())) == 0

"""collate_rows: one row (THD micro-batch) and several rows (one THD sequence, cu_seqlens over all tokens)."""

import torch

from packsft.data.collate import collate_rows
from packsft.data.row import build_row

X = -100


def rows():
    a, _ = build_row([([1, 2, 3], [X, 2, 3]), ([4, 5], [4, 5])], pad_id=0, max_seq_len=8)
    b, _ = build_row([([6, 7, 8, 9], [X, X, 8, 9])], pad_id=0, max_seq_len=8)
    return a, b


def test_one_row_is_a_thd_micro_batch_of_shape_1_by_L():
    a, _ = rows()
    batch = collate_rows([a])
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[key].shape == (1, 8) and torch.equal(batch[key][0], a[key])
    assert batch["cu_seqlens_padded"].tolist() == [0, 3, 8] and batch["cu_seqlens_padded"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 3, 5] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 3 and batch["num_trained_tokens"] == a["num_trained_tokens"] == 3


def test_several_rows_offset_cu_seqlens_by_row_and_sum_trained_tokens():
    a, b = rows()
    batch = collate_rows([a, b, a])
    assert batch["tokens"].shape == (1, 24) and batch["loss_mask"].dtype == torch.float32
    assert torch.equal(batch["labels"][0, 8:16], b["labels"])
    assert batch["cu_seqlens_padded"].tolist() == [0, 3, 8, 16, 19, 24]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9, 12, 14]       # real lengths 3, 2 | 4 | 3, 2
    assert batch["max_seqlen"] == 4
    assert batch["num_trained_tokens"] == 3 + 2 + 3 == int(batch["loss_mask"].sum())
    flat = batch["position_ids"].flatten()
    starts = batch["cu_seqlens_padded"][:-1].long()
    assert (flat[starts] == 0).all()                      # every segment starts at position 0


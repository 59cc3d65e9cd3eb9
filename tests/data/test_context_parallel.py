import pytest
import torch

from packsft.data.context_parallel import make_packed_seq_params, slice_batch_for_cp
from packsft.layout import cp_partition_indices

CU_DESIGN = torch.tensor([0, 4, 8], dtype=torch.int32)


@pytest.mark.parametrize(
    ("cu", "cp", "rank", "expected"),
    [
        ([0, 3, 8], 1, 0, list(range(8))),
        ([0, 4, 8], 2, 0, [0, 3, 4, 7]),
        ([0, 4, 8], 2, 1, [1, 2, 5, 6]),                  # DESIGN §6
        ([0, 8, 12], 2, 0, [0, 1, 6, 7, 8, 11]),
        ([0, 8, 12], 2, 1, [2, 3, 4, 5, 9, 10]),
        ([0, 8, 24], 4, 0, [0, 7, 8, 9, 22, 23]),
        ([0, 8, 24], 4, 1, [1, 6, 10, 11, 20, 21]),
        ([0, 8, 24], 4, 2, [2, 5, 12, 13, 18, 19]),
        ([0, 8, 24], 4, 3, [3, 4, 14, 15, 16, 17]),
    ],
)
def test_hand_written_indices(cu, cp, rank, expected):
    idx = cp_partition_indices(torch.tensor(cu, dtype=torch.int32), cp, rank)
    assert idx.dtype == torch.int64
    assert idx.tolist() == expected


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_union_of_ranks_is_the_row(cp):
    gen = torch.Generator().manual_seed(cp)
    lengths = (torch.randint(1, 6, (7,), generator=gen) * 2 * cp).tolist()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    parts = [cp_partition_indices(cu, cp, r) for r in range(cp)]
    assert all(p.numel() == int(cu[-1]) // cp for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(int(cu[-1])))


def test_rank_zero_holds_first_and_last_chunk_of_each_segment():
    idx = cp_partition_indices(torch.tensor([0, 12, 24]), 3, 0).tolist()
    assert idx == [0, 1, 10, 11, 12, 13, 22, 23]


def _row(length=8):
    return {
        "tokens": torch.arange(100, 100 + length),
        "labels": torch.arange(200, 200 + length)[None],
        "loss_mask": torch.linspace(0, 1, length),
        "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])[None],
        "cu_seqlens": CU_DESIGN,
        "max_seqlen": 4,
    }


def test_slice_batch_keeps_this_ranks_tokens_and_global_metadata():
    batch = _row()
    out = slice_batch_for_cp(batch, cp_size=2, cp_rank=1)
    assert out["tokens"].tolist() == [101, 102, 105, 106]
    assert out["labels"].tolist() == [[201, 202, 205, 206]]
    assert out["position_ids"].tolist() == [[1, 2, 1, 2]]
    assert torch.equal(out["loss_mask"], batch["loss_mask"][[1, 2, 5, 6]])
    assert out["cu_seqlens"] is batch["cu_seqlens"] and out["max_seqlen"] == 4
    assert batch["tokens"].numel() == 8                      # input untouched


def test_slice_batch_ranks_reassemble_the_row():
    batch = _row()
    parts = [slice_batch_for_cp(batch, 2, r) for r in range(2)]
    idx = torch.cat([cp_partition_indices(CU_DESIGN, 2, r) for r in range(2)])
    tokens = torch.empty(8, dtype=torch.int64)
    tokens[idx] = torch.cat([p["tokens"] for p in parts])
    assert torch.equal(tokens, batch["tokens"])


def test_slice_batch_cp1_is_identity():
    batch = _row()
    assert slice_batch_for_cp(batch, 1, 0)["tokens"] is batch["tokens"]


def test_make_packed_seq_params():
    psp = make_packed_seq_params(torch.tensor([0, 4, 8]), torch.tensor(4))
    assert psp.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(psp, name).dtype == torch.int32
        assert getattr(psp, name).tolist() == [0, 4, 8]
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 4 and isinstance(psp.max_seqlen_q, int)
    assert psp.cp_group is None


@pytest.mark.parametrize("cp", [2, 4])
def test_matches_transformer_engine(cp):
    tex = pytest.importorskip("transformer_engine_torch")
    if not torch.cuda.is_available():
        pytest.skip("thd_get_partitioned_indices is a CUDA kernel")
    cu = torch.tensor([0, 8 * cp, 12 * cp, 20 * cp], dtype=torch.int32, device="cuda")
    for rank in range(cp):
        te_idx = tex.thd_get_partitioned_indices(cu, int(cu[-1]), cp, rank)
        assert cp_partition_indices(cu, cp, rank).tolist() == te_idx.tolist()


def test_make_packed_seq_params_passes_real_and_padded_offsets_te_style():
    """cu_seqlens_q/kv = real lengths, *_padded = the row's offsets; max_seqlen covers the padded segments."""
    psp = make_packed_seq_params(torch.tensor([0, 3, 8]), 5, cu_seqlens_padded=torch.tensor([0, 4, 12]))
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 3, 8]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 4, 12]
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 8   # Megatron's THD RoPE needs a position per padded token


def test_cp_slicing_follows_the_padded_offsets_of_a_built_row():
    from packsft.data.row import build_row

    row, _ = build_row([([1, 2, 3], [-100, 2, 3]), ([4, 5, 6, 7, 8], [-100, -100, 6, 7, 8])], pad_id=0,
                       max_seq_len=12, context_parallel_size=2)
    assert row["cu_seqlens"].tolist() == [0, 3, 8] and row["cu_seqlens_padded"].tolist() == [0, 4, 12]
    local = slice_batch_for_cp(row, 2, 1)
    assert local["tokens"].tolist() == row["tokens"][[1, 2, 6, 7, 8, 9]].tolist()   # docs/loader.md example
    assert local["cu_seqlens"] is row["cu_seqlens"]

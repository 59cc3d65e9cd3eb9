import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from megatron.core.transformer.enums import AttnMaskType

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.attention import TorchCoreAttention
from packsft.model.config import ModelConfig

NP, NG, HN = 4, 2, 16
CU = [0, 7, 19, 24, 32]


@pytest.fixture(scope="module")
def attn(parallel_state_1proc):  # noqa: F811
    cfg = ModelConfig(num_layers=1, hidden_size=NP * HN, ffn_hidden_size=128, num_attention_heads=NP,
                      num_query_groups=NG, vocab_size=100, max_position_embeddings=64)
    return TorchCoreAttention(cfg.to_transformer_config(), layer_number=1,
                              attn_mask_type=AttnMaskType.causal, attention_type="self")


def _qkv(t, seed=0, batch=None):
    gen = torch.Generator().manual_seed(seed)
    lead = (t,) if batch is None else (t, batch)
    return (torch.randn(*lead, NP, HN, generator=gen), torch.randn(*lead, NG, HN, generator=gen),
            torch.randn(*lead, NG, HN, generator=gen))


def _naive(q, k, v, allowed):
    """Explicit softmax attention, GQA by repeat; q [s, np, hn], k/v [s, ng, hn], allowed bool [s, s]."""
    k, v = (x.repeat_interleave(NP // NG, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / HN**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).flatten(1)


def _doc_causal_mask(cu):
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    pos = torch.arange(cu[-1])
    return (pos[:, None] >= pos[None, :]) & (doc[:, None] == doc[None, :])


def test_thd_equals_each_conversation_alone(attn):
    q, k, v = _qkv(32)
    out = attn(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor(CU), 12))
    assert out.shape == (32, NP * HN)
    for s, e in zip(CU[:-1], CU[1:]):
        alone = attn(q[s:e, None], k[s:e, None], v[s:e, None], None)      # sbhd, one sequence
        torch.testing.assert_close(out[s:e], alone[:, 0], atol=1e-5, rtol=0)


def test_thd_matches_dense_block_diagonal_reference(attn):
    q, k, v = _qkv(32, seed=1)
    out = attn(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor(CU), 12))
    torch.testing.assert_close(out, _naive(q, k, v, _doc_causal_mask(CU)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["fallback", "varlen"])
def test_conversations_are_isolated(attn, path):
    """No token sees another conversation, on the per-conversation fallback and on the varlen path (driven by a
    reference kernel of varlen_attn's contract)."""
    if path == "varlen":
        from packsft.model.attention import AttentionKernel

        attn = _with_kernel(attn, AttentionKernel("reference", reference_varlen))
    q, k, v = _qkv(32, seed=2)
    psp = make_packed_seq_params(torch.tensor(CU), 12)
    base = attn(q, k, v, None, packed_seq_params=psp)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[9] += 5.0                                   # one token of conversation 1 (rows 7..18)
    changed = attn(q2, k2, v2, None, packed_seq_params=psp)
    outside = torch.cat([torch.arange(0, 7), torch.arange(19, 32)])
    assert torch.equal(changed[outside], base[outside])
    assert not torch.allclose(changed[9:19], base[9:19])       # the token and its successors move
    assert torch.equal(changed[7:9], base[7:9])                # its predecessors do not (causal)


def test_padded_cu_seqlens_take_precedence(attn):
    q, k, v = _qkv(32, seed=3)
    psp = make_packed_seq_params(torch.tensor(CU), 12)
    psp.cu_seqlens_q = torch.tensor([0, 32], dtype=torch.int32)  # would merge everything if used
    out = attn(q, k, v, None, packed_seq_params=psp)
    torch.testing.assert_close(out, _naive(q, k, v, _doc_causal_mask(CU)), atol=1e-5, rtol=0)


def test_sbhd_is_plain_causal(attn):
    q, k, v = _qkv(10, seed=4, batch=2)
    out = attn(q, k, v, None)
    assert out.shape == (10, 2, NP * HN)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    for b in range(2):
        torch.testing.assert_close(out[:, b], _naive(q[:, b], k[:, b], v[:, b], causal), atol=1e-5, rtol=0)


def test_gradients_match_reference(attn):
    q, k, v = (x.requires_grad_() for x in _qkv(32, seed=5))
    attn(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor(CU), 12)).square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    _naive(q, k, v, _doc_causal_mask(CU)).square().sum().backward()
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=0)


def test_offsets_that_do_not_cover_the_row_are_asserted(attn):
    """``cu_seqlens[-1]`` is the row's token count: the data path builds it so (an invariant, asserted)."""
    q, k, v = _qkv(4)
    with pytest.raises(AssertionError, match="cu_seqlens"):
        attn(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor([0, 3]), 3))


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """The ``varlen_attn`` contract (``packsft.model.attention.VarlenKernel``) on SDPA with a dense mask: sequence
    ``i`` is ``q[cu_q[i]:cu_q[i+1]]`` over ``k[cu_k[i]:cu_k[i+1]]``, causal bottom-right aligned, GQA. For tests."""
    cq, ck = cu_q.long(), cu_k.long()
    assert int((cq.diff()).max()) <= max_q and int((ck.diff()).max()) <= max_k
    sq = torch.searchsorted(cq[1:], torch.arange(q.shape[0]), right=True)
    sk = torch.searchsorted(ck[1:], torch.arange(k.shape[0]), right=True)
    iq, ik = torch.arange(q.shape[0]) - cq[sq], torch.arange(k.shape[0]) - ck[sk]
    shift = (ck.diff() - cq.diff())[sq]                      # lk - lq of each query's sequence
    mask = (sq[:, None] == sk[None, :]) & (ik[None, :] <= iq[:, None] + shift[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1)


def _with_kernel(attn, kernel):
    layer = TorchCoreAttention(attn.config, 1, AttnMaskType.causal, "self")
    layer.kernel = kernel
    return layer


def test_varlen_path_gives_the_loops_outputs_and_gradients(attn):
    """cp=1: the varlen path's inputs (the row's offsets, the longest segment, [t, n, hn] layouts, GQA) through a
    reference kernel with varlen_attn's contract reproduce the per-conversation loop, forward and backward."""
    from packsft.model.attention import AttentionKernel

    cu = [0, 7, 19, 19, 24, 32]                                 # with an empty segment
    varlen = _with_kernel(attn, AttentionKernel("reference", reference_varlen))
    loop = _with_kernel(attn, AttentionKernel("loop", None))
    results = []
    for layer in (varlen, loop):
        q, k, v = (x.requires_grad_() for x in _qkv(32, seed=6))
        out = layer(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor(cu), 12))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(results[0][0], _naive(*_qkv(32, seed=6), _doc_causal_mask(cu)), atol=1e-5, rtol=0)


def test_context_parallel_plan_feeds_one_varlen_call_per_rank():
    """cp=2, 3: the plan's zigzag positions are TE's, and one varlen call with the rank's two chunks per
    conversation as queries over their causal key prefixes (bottom-right aligned) gives the row's attention."""
    from packsft.layout import cp_partition_indices
    from packsft.model.attention import context_parallel_plan

    q, k, v = _qkv(48, seed=7)
    for cp, cu in ((2, [0, 8, 20, 20, 24, 48]), (3, [0, 12, 24, 48])):
        want = _naive(q, k, v, _doc_causal_mask(cu))
        ranks = [cp_partition_indices(torch.tensor(cu), cp, r) for r in range(cp)]
        gathered_k, gathered_v = torch.cat([k[i] for i in ranks]), torch.cat([v[i] for i in ranks])
        for r, index in enumerate(ranks):
            plan = context_parallel_plan(cu, cp, r, "cpu")
            assert torch.equal(plan.q_pos, index) and torch.equal(gathered_k[plan.order], k)
            out = reference_varlen(q[index], gathered_k[plan.k_index], gathered_v[plan.k_index], plan.cu_q,
                                   plan.cu_k, plan.max_q, plan.max_k, HN**-0.5)
            torch.testing.assert_close(out.flatten(1), want[index], atol=1e-5, rtol=0)


def test_kernel_choice_by_device_dtype_and_varlen_signature(monkeypatch):
    """varlen_attn only on CUDA in bf16/fp16; causal and GQA arguments by the installed signature (2.10 is_causal,
    2.11 window_size without enable_gqa: K/V repeated, 2.12+ enable_gqa)."""
    import torch.nn.attention.varlen as varlen_module

    from packsft.model.attention import select_attention_kernel

    assert select_attention_kernel("cpu", torch.float32).varlen is None
    assert "CPU fallback" in select_attention_kernel("cpu", torch.bfloat16).name
    assert select_attention_kernel("cuda", torch.float32).varlen is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))   # a T4
    select_attention_kernel.cache_clear()
    try:
        assert "8.0" in select_attention_kernel("cuda", torch.bfloat16).name
    finally:
        select_attention_kernel.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))   # an H100
    calls = []

    def v210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append((key.shape[1], {"is_causal": is_causal}))
        return query

    def v211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1)):
        calls.append((key.shape[1], {"window_size": window_size, "scale": scale}))
        return query

    def v212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False):
        calls.append((key.shape[1], {"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa}))
        return query

    q, k, v = _qkv(8)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    expected = [(NP, {"is_causal": True}), (NP, {"window_size": (-1, 0), "scale": 0.5}),
                (NG, {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True})]
    for fake, want in zip((v210, v211, v212), expected):
        monkeypatch.setattr(varlen_module, "varlen_attn", fake)
        select_attention_kernel.cache_clear()
        try:
            choice = select_attention_kernel("cuda", torch.bfloat16)
            assert choice.name == "varlen_attn (FlashAttention-2)"
            choice.varlen(q, k, v, cu, cu, 8, 8, 0.5)
        finally:
            select_attention_kernel.cache_clear()
        assert calls.pop() == want
    monkeypatch.delattr(varlen_module, "varlen_attn")
    select_attention_kernel.cache_clear()
    try:
        assert "no varlen_attn" in select_attention_kernel("cuda", torch.bfloat16).name
    finally:
        select_attention_kernel.cache_clear()

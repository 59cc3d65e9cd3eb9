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


def test_conversations_are_isolated(attn):
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


def test_rejects_what_it_does_not_implement(attn):
    q, k, v = _qkv(4)
    with pytest.raises(NotImplementedError, match="attention_mask"):
        attn(q[:, None], k[:, None], v[:, None], torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="causal"):
        TorchCoreAttention(attn.config, 1, AttnMaskType.no_mask, "self")
    with pytest.raises(ValueError, match="cu_seqlens"):
        attn(q, k, v, None, packed_seq_params=make_packed_seq_params(torch.tensor([0, 3]), 3))

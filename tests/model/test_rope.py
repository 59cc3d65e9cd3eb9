"""packsft's sync-free THD RoPE (``packsft.model.rope``) is Megatron-Core's, bit for bit, without host reads."""

import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from torch.overrides import TorchFunctionMode

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model import rope
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.output_head import use_hidden_state_output
from packsft.train.token_loss import gpt_token_loss

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.nonzero, torch.Tensor.cpu, torch.Tensor.numpy}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in READS
        return func(*args, **(kwargs or {}))


class FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("exact", [False, True], ids=["restart", "exact_mapping"])
def test_rotation_equals_megatrons_for_every_cp_rank(cp, exact):
    lengths = [6 * cp, 0, 12 * cp, 2 * cp, 4 * cp]          # multiples of 2 cp, one empty
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(cp)
    freqs = torch.rand(total if exact else max(lengths), 1, 1, 8, generator=gen) * 10
    for r in range(cp):
        t = torch.randn(total // cp, 3, 10, generator=gen)
        want = rope._MEGATRON_THD(t, cu, freqs, cp_group=FakeGroup(cp, r))
        rope._CACHE.clear()
        with CountReads() as reads:
            got = rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=FakeGroup(cp, r))
        assert torch.equal(got, want) and reads.count == 0


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    with CountReads() as reads:
        loss, _ = gpt_token_loss(model, batch, fused=True, chunk_size=16)
        loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, reads.count


def test_model_loss_and_gradients_are_bit_identical_and_read_nothing(parallel_state_1proc):  # noqa: F811
    torch.manual_seed(0)
    model = build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                        num_query_groups=2, vocab_size=256, max_position_embeddings=64))
    use_hidden_state_output(model)
    lengths = [9, 20, 3]
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 256, (1, 32), generator=gen)
    batch = {"tokens": torch.randint(0, 256, (1, 32), generator=gen), "labels": labels,
             "loss_mask": torch.ones(1, 32), "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
             "cu_seqlens": torch.tensor([0, 9, 29, 32]), "trained_index": torch.arange(32)}   # as the trainer
    batch["packed_seq_params"] = make_packed_seq_params(batch["cu_seqlens"], 20)
    ours = _loss_and_grads(model, batch)
    rope.uninstall_sync_free_rope()
    try:
        megatrons = _loss_and_grads(model, batch)
    finally:
        rope.install_sync_free_rope()
    assert torch.equal(ours[0], megatrons[0])
    assert all(torch.equal(ours[1][n], megatrons[1][n]) for n in ours[1])
    assert megatrons[2] == 4 * 2 and ours[2] == 0           # Megatron: tolist + bool for q and k, per layer

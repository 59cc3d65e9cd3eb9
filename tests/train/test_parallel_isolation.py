"""Conversations packed in one row do not see each other: changing one token of one conversation changes no logit
of any other conversation, at cp=1 (in process) and cp=2 (2 gloo processes).

Row: a real packed row (the shortest hh-rlhf conversations, SmolLM2 tokenizer, ``max_seq_len`` 256, packed for
CP=2) with at least 3 conversations. The model is the tiny GPT with its normal (stock) output layer, fp32; the
logits ``[t, v]`` of the original row and of the row with one token of its middle conversation replaced are compared.
"""


import pytest
import torch
from distributed_helpers import parallel_state_1proc, run_distributed, short_conversation_lines  # noqa: F401 - fixture

from packsft.data.collate import collate_rows
from packsft.layout import cp_partition_indices
from packsft.model.config import ModelConfig
from packsft.train.data import model_input

SEQ, CP, VOCAB = 256, 2, 49152


@pytest.fixture(scope="module")
def row(tmp_path_factory, shared_data, tokenizer_dir) -> dict:
    """One collated real row (CP=2 padding) with >= 3 conversations, and the index of its changed token."""
    from packsft.data.dataset import PackedSFTDataset
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    out = tmp_path_factory.mktemp("isolation")
    (out / "in.jsonl").write_text("\n".join(short_conversation_lines(shared_data, 6)) + "\n")
    tokenizer = str(tokenizer_dir("smollm2-135m-instruct"))
    run_pack(PackConfig(inputs=[str(out / "in.jsonl")], output=str(out / "rows.jsonl.packed"), max_seq_len=SEQ,
                        algorithm="next-fit", context_parallel_size=CP, tokenizer=tokenizer, histogram="",
                        progress=False))
    batch = collate_rows([PackedSFTDataset(out / "rows.jsonl.packed", tokenizer, "chat-template", SEQ, CP)[0]])
    cu = batch["cu_seqlens_padded"].tolist()
    assert len(cu) >= 4, cu                                   # >= 3 conversations
    changed = (cu[1] + cu[2]) // 2                            # middle of the second conversation
    return {"batch": batch, "changed": changed}


def _model():
    from packsft.model.gpt import build_gpt_model

    torch.manual_seed(3)
    return build_gpt_model(ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                       num_query_groups=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                       tie_word_embeddings=True))


def _logits_pair(row, cp_size, cp_rank, cp_group):
    """Logits ``[t_local, v]`` of the row and of the row with token ``changed`` replaced, on this CP rank."""
    model = _model().eval()
    edited = dict(row["batch"])
    edited["tokens"] = edited["tokens"].clone()
    edited["tokens"][0, row["changed"]] = (edited["tokens"][0, row["changed"]] + 1000) % VOCAB
    out = []
    with torch.no_grad():
        for batch in (row["batch"], edited):
            b = model_input(batch, cp_size, cp_rank, cp_group, torch.device("cpu"))
            out.append(model(b["tokens"], b["position_ids"], None, packed_seq_params=b["packed_seq_params"])[0])
    return out


def _check(row, index, original, edited):
    """Assert logits of other conversations are unchanged and the edited conversation's later ones changed."""
    cu = row["batch"]["cu_seqlens_padded"].tolist()
    changed = row["changed"]
    other = (index < cu[1]) | (index >= cu[2])
    before = (index >= cu[1]) & (index < changed)
    after = (index >= changed) & (index < cu[2])
    diff = (original - edited).abs().amax(dim=-1)                        # [t_local]
    assert other.any() and after.any()
    assert diff[other].max().item() <= 1e-6, diff[other].max().item()
    if before.any():
        assert diff[before].max().item() <= 1e-6                        # causal inside the conversation too
    assert diff[after].max().item() > 1e-3                              # the edit is seen where it should be
    return diff[other].max().item()


def test_cp1_other_conversations_unchanged(row, parallel_state_1proc):  # noqa: F811
    original, edited = _logits_pair(row, 1, 0, None)
    assert original.shape == (SEQ, VOCAB)
    print("cp=1 max |logit diff| of other conversations:", _check(row, torch.arange(SEQ), original, edited))


def _cp_worker(rank, world_size, row):
    from packsft.train.distributed import init_distributed

    ctx = init_distributed(context_parallel_size=world_size)
    return ctx.cp_rank, _logits_pair(row, world_size, ctx.cp_rank, ctx.cp_group)


@pytest.mark.distributed
@pytest.mark.slow
def test_cp2_other_conversations_unchanged(row):
    for cp_rank, (original, edited) in run_distributed(_cp_worker, CP, row):
        index = cp_partition_indices(row["batch"]["cu_seqlens_padded"], CP, cp_rank)
        assert original.shape == (SEQ // CP, VOCAB)
        print(f"cp=2 rank {cp_rank} max |logit diff| of other conversations:", _check(row, index, original, edited))

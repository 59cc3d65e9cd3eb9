"""Row builder: hand-computed tensors, truncation, Megatron-LM parity, and the packer's cost == loader's allotment."""

import functools
import random

import pytest
import torch

from packsft.data.row import RowTruncation, build_row
from packsft.layout import IGNORE_INDEX, conversation_cost
from packsft.prompt_formats import Tokenization, get_prompt_format, tokenize_conversation
from packsft.tokenizer import load_tokenizer

X = IGNORE_INDEX


def _check(row, tokens, labels, loss_mask, position_ids, cu_seqlens, max_seqlen, real=None):
    """``cu_seqlens``: the padded offsets; ``real``: the expected real ``cu_seqlens`` (default: the same)."""
    assert row["tokens"].dtype == row["labels"].dtype == row["position_ids"].dtype == torch.int64
    assert row["loss_mask"].dtype == torch.float32 and row["cu_seqlens_padded"].dtype == torch.int32
    assert row["tokens"].tolist() == tokens
    assert row["labels"].tolist() == labels
    assert row["loss_mask"].tolist() == loss_mask
    assert row["position_ids"].tolist() == position_ids
    assert row["cu_seqlens_padded"].tolist() == cu_seqlens
    assert row["cu_seqlens"].tolist() == (cu_seqlens if real is None else real)
    assert row["cu_seqlens"].dtype == torch.int32
    assert row["max_seqlen"] == max_seqlen and isinstance(row["max_seqlen"], int)
    assert row["num_trained_tokens"] == sum(loss_mask)


def test_cp1_docstring_example_masks_the_label_crossing_into_the_next_conversation():
    row, trunc = build_row([([5, 6, 7], [X, 6, 7]), ([8, 9], [8, 9])], pad_id=0, max_seq_len=6)
    assert trunc is None
    _check(row, tokens=[5, 6, 7, 8, 9, 0], labels=[6, 7, X, 9, X, X], loss_mask=[1, 1, 0, 1, 0, 0],
           position_ids=[0, 1, 2, 0, 1, 2], cu_seqlens=[0, 3, 6], max_seqlen=3, real=[0, 3, 5])


def test_cp2_pads_each_conversation_to_a_multiple_of_4_and_stops_at_exactly_L():
    row, trunc = build_row([([1, 2, 3], [X, 2, 3]), ([4, 5, 6, 7, 8], [X, X, 6, 7, 8])], pad_id=0,
                           max_seq_len=12, context_parallel_size=2)
    assert trunc is None
    _check(row, tokens=[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0], labels=[2, 3, X, X, X, 6, 7, 8, X, X, X, X],
           loss_mask=[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0], position_ids=[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7],
           cu_seqlens=[0, 4, 12], max_seqlen=5, real=[0, 3, 8])
    from packsft.layout import cp_partition_indices

    assert cp_partition_indices(row["cu_seqlens_padded"], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]  # docs/loader.md example


def test_cp4_boundary_label_on_a_pad_position_is_masked():
    # identity-like targets: Megatron-LM would train position 7 (a pad token) to predict 4, the next conversation
    row, _ = build_row([([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5])], pad_id=0, max_seq_len=16, context_parallel_size=4)
    _check(row, tokens=[1, 2, 3, 0, 0, 0, 0, 0, 4, 5, 0, 0, 0, 0, 0, 0], labels=[2, 3] + [X] * 6 + [5] + [X] * 7,
           loss_mask=[1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0], position_ids=list(range(8)) * 2,
           cu_seqlens=[0, 8, 16], max_seqlen=3, real=[0, 3, 5])


def test_tail_padding_belongs_to_the_last_segment_and_continues_its_positions():
    row, _ = build_row([([1, 2], [1, 2]), ([3, 4, 5], [3, 4, 5])], pad_id=9, max_seq_len=10)
    _check(row, tokens=[1, 2, 3, 4, 5, 9, 9, 9, 9, 9], labels=[2, X, 4, 5, X, X, X, X, X, X],
           loss_mask=[1, 0, 1, 1, 0, 0, 0, 0, 0, 0], position_ids=[0, 1, 0, 1, 2, 3, 4, 5, 6, 7],
           cu_seqlens=[0, 2, 10], max_seqlen=3, real=[0, 2, 5])


def test_a_trained_token_equal_to_the_pad_id_is_not_trained_as_in_megatron():
    row, _ = build_row([([1, 7, 2], [1, 7, 2])], pad_id=7, max_seq_len=4)
    assert row["labels"].tolist() == [X, 2, X, X] and row["loss_mask"].tolist() == [0, 1, 0, 0]


def test_right_truncation_cuts_the_crossing_conversation_and_drops_later_ones():
    convs = [([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]), ([6, 7, 8, 9, 10], [6, 7, 8, 9, 10]), ([11, 12], [11, 12])]
    row, trunc = build_row(convs, pad_id=0, max_seq_len=8)
    _check(row, tokens=[1, 2, 3, 4, 5, 6, 7, 8], labels=[2, 3, 4, 5, X, 7, 8, X],
           loss_mask=[1, 1, 1, 1, 0, 1, 1, 0], position_ids=[0, 1, 2, 3, 4, 0, 1, 2], cu_seqlens=[0, 5, 8],
           max_seqlen=5)
    assert trunc == RowTruncation(needed_tokens=12, max_seq_len=8, cut_conversation=1, cut_conversation_tokens=5,
                                  kept_tokens=3, dropped_conversations=(2,))
    text = trunc.describe()
    assert "need 12 tokens but max_seq_len is 8" in text
    assert "conversation 1 (5 tokens) was cut after 3 tokens (2 removed)" in text and "[2] were dropped" in text


def test_a_full_row_drops_the_conversations_after_it_without_cutting():
    row, trunc = build_row([([1] * 8, [1] * 8), ([2, 3], [2, 3])], pad_id=0, max_seq_len=8)
    assert row["cu_seqlens_padded"].tolist() == [0, 8] and row["tokens"].tolist() == [1] * 8
    assert trunc.cut_conversation is None and trunc.dropped_conversations == (1,)
    assert "was cut" not in trunc.describe()


def test_single_oversize_conversation_with_cp_is_truncated_to_L():
    row, trunc = build_row([(list(range(1, 12)), list(range(1, 12)))], pad_id=0, max_seq_len=8,
                           context_parallel_size=2)
    _check(row, tokens=list(range(1, 9)), labels=list(range(2, 9)) + [X], loss_mask=[1] * 7 + [0],
           position_ids=list(range(8)), cu_seqlens=[0, 8], max_seqlen=8)
    assert (trunc.cut_conversation, trunc.cut_conversation_tokens, trunc.kept_tokens) == (0, 11, 8)
    assert trunc.needed_tokens == 12


def test_row_without_trained_token_has_zero_loss_mask():
    row, _ = build_row([([1, 2, 3], [X, X, X])], pad_id=0, max_seq_len=4)
    assert row["num_trained_tokens"] == 0 and row["loss_mask"].sum() == 0
    assert (row["labels"] == X).all()


def test_tokens_and_targets_of_unequal_length_are_refused():
    with pytest.raises(ValueError, match=r"targets \(1\) must hold the first"):
        build_row([([1, 2], [1])], pad_id=0, max_seq_len=8)


def megatron_reference(conversations, pad, pack_length, cp):
    """Megatron-LM ``SFTDataset.__getitem__`` (megatron/training/datasets/sft_dataset.py), re-typed without
    the EOD append (packsft's formats render their own end of turn) and without its tokenizer."""
    toks, tgts, pos, cu = [], [], [], [0]
    for tokens, targets in conversations:
        toks += tokens
        tgts += targets
        pos += range(len(tokens))
        if cp > 1 and len(toks) % (2 * cp):
            n = 2 * cp - len(toks) % (2 * cp)
            toks += [pad] * n
            tgts += [pad] * n
            pos += range(pos[-1] + 1, pos[-1] + 1 + n)
        cu.append(len(toks))
        if len(toks) >= pack_length + 1:
            toks, tgts = toks[:pack_length] + [pad], tgts[:pack_length] + [pad]
            pos = pos[: pack_length + 1]
            cu[-1] = len(toks) - 1
            break
    if len(toks) < pack_length + 1:
        n = pack_length + 1 - len(toks)
        toks += [pad] * n
        tgts += [pad] * n
        pos += range(pos[-1] + 1, pos[-1] + 1 + n)
        cu[-1] = len(toks) - 1
    labels = torch.tensor(tgts[1:])
    loss_mask = ((labels != pad) & (labels != X)).float()
    return {"tokens": torch.tensor(toks[:-1]), "labels": labels, "loss_mask": loss_mask,
            "position_ids": torch.tensor(pos[:-1]), "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("identity", [False, True])
def test_matches_megatron_except_the_documented_differences(cp, identity):
    rng = random.Random(cp * 10 + identity)
    pad, length = 0, 64
    for _ in range(200):
        convs = []
        for _ in range(rng.randint(1, 5)):
            tokens = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
            masked = 0 if identity else rng.randint(1, len(tokens))   # prompt presets start with a masked turn
            convs.append((tokens, [X] * masked + tokens[masked:]))
        costs = [conversation_cost(len(t), cp) for t, _ in convs]
        if sum(costs[:-1]) >= length:  # Megatron's empty last segment after an exactly full row
            continue
        ref, (row, _) = megatron_reference(convs, pad, length, cp), build_row(convs, pad, length, cp)
        for key in ("tokens", "position_ids"):
            assert torch.equal(row[key], ref[key]), key
        assert torch.equal(row["cu_seqlens_padded"], ref["cu_seqlens"])   # Megatron's offsets are the padded ones
        kept = len(row["cu_seqlens"]) - 1
        real = [min(len(t), length - int(row["cu_seqlens_padded"][k])) for k, (t, _) in enumerate(convs[:kept])]
        assert (row["cu_seqlens"][1:] - row["cu_seqlens"][:-1]).tolist() == real
        assert row["max_seqlen"] == max(real)
        boundary = row["cu_seqlens_padded"][1:-1].long() - 1
        same = torch.ones(length, dtype=torch.bool)
        same[boundary] = False
        assert torch.equal(row["loss_mask"][same], ref["loss_mask"][same])
        assert (row["loss_mask"][boundary] == 0).all()
        if not identity:  # the difference only shows with identity targets
            assert torch.equal(row["loss_mask"], ref["loss_mask"])
        trained = row["loss_mask"].bool()
        assert torch.equal(row["labels"][trained], ref["labels"][trained])
        assert (row["labels"][~trained] == X).all()


# Two conversations rendered by each preset (lengths and trained text read off the renderings).
CONV_1 = [{"role": "system", "content": ""}, {"role": "user", "content": "Capital of France?"},
          {"role": "assistant", "content": "Paris."}]
CONV_2 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}]
PRESET_CASES = {
    # (tokenizer, preset): (n1, n2, text of the trained labels in row order, number of trained tokens)
    # identity masks system and user turns, as Megatron-LM does
    ("nemotron-h-layout-tekken", "identity"): (6, 8, "Paris.4", 2 + 1),
    ("nemotron-h-layout-tekken", "nemotron-nano-v2"): (17, 20, "Paris.\n<SPECIAL_12>\n4\n<SPECIAL_12>\n", 4 + 4),
    ("nemotron-h-layout-tekken", "nemotron-h-aligned"): (15, 18, "Paris.\n4\n", 2 + 2),
    ("qwen2.5", "chat-template"): (21, 23, "Paris.<|im_end|>4<|im_end|>", 3 + 2),
    ("smollm2-135m-instruct", "chat-template"): (22, 24, "Paris.<|im_end|>4<|im_end|>", 3 + 2),
}
_tokenizer = functools.lru_cache(load_tokenizer)
FIRST_COST = {  # hand-computed ceil(n1 / (2 cp)) * 2 cp
    1: {6: 6, 17: 17, 15: 15, 21: 21, 22: 22},
    2: {6: 8, 17: 20, 15: 16, 21: 24, 22: 24},
    4: {6: 8, 17: 24, 15: 16, 21: 24, 22: 24},
}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize(("tokenizer_name", "preset"), list(PRESET_CASES))
def test_presets_hand_computed(tokenizer_dir, tokenizer_name, preset, cp):
    tok = _tokenizer(tokenizer_dir(tokenizer_name))
    fmt = get_prompt_format(preset, tok)
    n1, n2, trained_text, num_trained = PRESET_CASES[(tokenizer_name, preset)]
    convs = [tokenize_conversation(c, Tokenization.of(tok, fmt)) for c in (CONV_1, CONV_2)]
    assert [len(t) for t, _ in convs] == [n1, n2]
    row, trunc = build_row(convs, fmt.pad_token_id, max_seq_len=48, context_parallel_size=cp)
    c1 = FIRST_COST[cp][n1]
    assert trunc is None
    assert row["cu_seqlens_padded"].tolist() == [0, c1, 48] and row["max_seqlen"] == max(n1, n2)
    assert row["cu_seqlens"].tolist() == [0, n1, n1 + n2]
    assert row["position_ids"].tolist() == list(range(c1)) + list(range(48 - c1))
    tokens = row["tokens"].tolist()
    assert tokens[:n1] == convs[0][0] and tokens[c1:c1 + n2] == convs[1][0]
    assert tokens[n1:c1] == [fmt.pad_token_id] * (c1 - n1) and all(t == fmt.pad_token_id for t in tokens[c1 + n2:])
    trained = row["loss_mask"].bool()
    assert tok.decode(row["labels"][trained].tolist()) == trained_text
    assert row["num_trained_tokens"] == num_trained
    where = trained.nonzero().flatten()
    assert (where < 47).all() and torch.equal(row["labels"][where], row["tokens"][where + 1])
    assert row["loss_mask"][c1 - 1] == 0  # last position of conversation 1: its label would cross


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_build_row_allots_exactly_the_packers_cost(cp):
    rng = random.Random(cp)
    for _ in range(100):
        n = rng.randint(1, 40)
        cost = conversation_cost(n, cp)
        row, trunc = build_row([([1] * n, [1] * n)], pad_id=0, max_seq_len=cost, context_parallel_size=cp)
        assert trunc is None and row["cu_seqlens_padded"].tolist() == [0, cost]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_slices_of_a_built_row_reassemble_it(cp):
    from packsft.data.context_parallel import slice_batch_for_cp
    from packsft.layout import cp_partition_indices

    rng = random.Random(cp)
    convs = [([rng.randint(1, 9) for _ in range(n)], [X] + [1] * (n - 1)) for n in (5, 1, 12, 7)]
    row, _ = build_row(convs, pad_id=0, max_seq_len=64, context_parallel_size=cp)
    parts = [slice_batch_for_cp(row, cp, r) for r in range(cp)]
    index = torch.cat([cp_partition_indices(row["cu_seqlens_padded"], cp, r) for r in range(cp)])
    assert torch.equal(index.sort().values, torch.arange(64))
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        whole = torch.empty_like(row[key])
        whole[index] = torch.cat([p[key] for p in parts])
        assert torch.equal(whole, row[key]), key
        assert all(p[key].shape == (64 // cp,) for p in parts)
    assert sum(int(p["loss_mask"].sum()) for p in parts) == row["num_trained_tokens"]

"""A packed row as a person reads it: conversations, roles, trained tokens, positions and statistics.

Used by ``tools/inspect_packed.py``. The text is always re-tokenized here (the turns' spans need it); the header
says whether training reads the row's ids from the token cache (:mod:`packsft.token_cache`). A token is shown as
*trained* when the model is trained to predict it,
i.e. the label at the previous position is this token with ``loss_mask`` 1 (so a conversation's first token
is never trained). In color mode trained text is green, masked text plain, padding dim; without color
trained spans are wrapped in ``«`` ``»`` and padding is written ``<pad×N>``. A newline in the text is shown as
``↵`` followed by an indented line break.
"""

from __future__ import annotations

from dataclasses import dataclass

from packsft.conversation import split_row
from packsft.data.dataset import PackedSFTDataset
from packsft.data.row import build_row
from packsft.prompt_formats import Tokenization, tokenize_segments

GREEN, DIM, CYAN, BOLD, RESET = "\033[32m", "\033[2m", "\033[36m", "\033[1m", "\033[0m"


@dataclass(frozen=True)
class _Style:
    color: bool

    def trained(self, text: str) -> str:
        return f"{GREEN}{text}{RESET}" if self.color else f"«{text}»"

    def pad(self, count: int) -> str:
        text = f"<pad×{count}>"
        return f"{DIM}{text}{RESET}" if self.color else text

    def header(self, text: str) -> str:
        return f"{BOLD}{CYAN}{text}{RESET}" if self.color else text


def _segment_spans(conversation, dataset: PackedSFTDataset) -> list[tuple[str, int]]:
    """``(label, number of tokens)`` of each rendered piece of a conversation, in order."""
    fmt, tok = dataset.prompt_format, dataset.tokenizer
    spans = []
    for seg, ids in tokenize_segments(conversation.messages, Tokenization.of(tok, fmt), conversation.tools,
                                      conversation.chat_template_kwargs):
        if fmt.name in ("chat-template", "passthrough"):
            label = "assistant" if seg.trained else "prompt"
        else:
            label = conversation.messages[seg.turn]["role"]
        if ids:
            spans.append((label, len(ids)))
    return spans


def _render_tokens(tok, ids: list[int], trained: list[bool], style: _Style) -> str:
    """Decode ``ids`` in runs of equal ``trained`` flag, marking the trained runs; newlines shown as ``↵``."""
    out, start = [], 0
    for p in range(1, len(ids) + 1):
        if p == len(ids) or trained[p] != trained[start]:
            text = tok.decode(ids[start:p]).replace("\n", "↵\n    ")
            if p == len(ids) and text.endswith("\n    "):
                text = text[: -len("\n    ")]  # no empty indented line after the last newline
            out.append(style.trained(text) if trained[start] else text)
            start = p
    return "".join(out)


def describe_row(dataset: PackedSFTDataset, i: int, color: bool = False) -> str:
    """Text report of row ``i``: statistics, then each conversation with its turns and trained tokens.

    Args:
        dataset: the dataset (its tokenizer, prompt format, ``max_seq_len`` and CP size are used).
        i: row index (0-based; negative counts from the end).
        color: ANSI colors (for a terminal) instead of plain markers.

    Returns:
        Multi-line text, ending without a newline.

    Raises:
        IndexError, ConversationError: as :meth:`PackedSFTDataset.tokenize_row`.
    """
    style, tok, pad_id = _Style(color), dataset.tokenizer, dataset.prompt_format.pad_token_id
    conversations = split_row(dataset.read_messages(i), dataset.path, dataset.line_number(i))
    pieces = dataset.tokenize_row(i)
    row, truncation = build_row(pieces, pad_id, dataset.max_seq_len, dataset.context_parallel_size)
    tokens, mask, cu = row["tokens"].tolist(), row["loss_mask"], row["cu_seqlens_padded"].tolist()
    trained = [False] + (mask[:-1] > 0).tolist()   # token p is trained when the label at p - 1 is it
    length = dataset.max_seq_len
    real = sum(min(len(pieces[k][0]), cu[k + 1] - cu[k]) for k in range(len(cu) - 1))
    lines = [style.header(f"row {i % len(dataset)} of {len(dataset)} ({dataset.path}:{dataset.line_number(i)})"),
             f"  conversations {len(conversations)}, max_seq_len {length}, context_parallel_size "
             f"{dataset.context_parallel_size}, prompt format {dataset.prompt_format.name}",
             f"  real tokens {real} ({real / length:.1%} of the row), padding {length - real}, "
             f"trained tokens {row['num_trained_tokens']}, max_seqlen {row['max_seqlen']}",
             f"  cu_seqlens {row['cu_seqlens'].tolist()} (real), cu_seqlens_padded {cu}",
             f"  token ids for training: {dataset.token_cache_status}"]
    if truncation is not None:
        lines.append(f"  TRUNCATED: {truncation.describe()}")
    if row["num_trained_tokens"] == 0:
        lines.append("  NO TRAINED TOKEN: this row contributes 0 to the loss")
    if not color:
        lines.append("  legend: «trained» (predicted with loss), plain = masked, <pad×N> = padding")
    for k, conv in enumerate(conversations):
        if k >= len(cu) - 1:
            lines.append(style.header(f"\n── conversation {k}: dropped (after max_seq_len) ──"))
            continue
        start, end = cu[k], cu[k + 1]
        n = min(len(pieces[k][0]), end - start)
        lines.append(style.header(f"\n── conversation {k} · row positions {start}..{end - 1} · {n} tokens, "
                                  f"{end - start - n} padding · {int(mask[start:end].sum())} trained ──"))
        offset = start
        for label, count in _segment_spans(conv, dataset):
            count = n - (offset - start) if count < 0 else count
            stop = min(offset + count, start + n)
            if stop <= offset:
                break
            text = _render_tokens(tok, tokens[offset:stop], trained[offset:stop], style)
            lines.append(f"{style.header(f'[{label}]')} position {offset - start}: {text}")
            offset = stop
        if end - (start + n):
            lines.append(style.pad(end - (start + n)))
    return "\n".join(lines)


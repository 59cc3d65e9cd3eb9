"""``--oversize split``: a conversation longer than a row cut at turn boundaries into pieces that fit one.

A piece is the conversation's system message (with its ``tools``) followed by ``messages[s : e + 1]``: a run of
the conversation's trained assistant turns (:func:`packsft.prompt_formats.trained_turns`) after as much of the
preceding conversation as fits, that context masked (``weight: 0`` on each trained turn it holds: an earlier
piece trains it). Every trained turn is trained in exactly one piece, with its end of turn, and each piece is
tokenized with :func:`packsft.prompt_formats.tokenize_conversation` as stored, so the loader gets the packer's
tokens. A piece never starts at a ``tool`` message: tool results stay with the assistant turn that called for
them. A trained turn that does not fit in a row after the system message alone is rejected (the pieces hold it
only as context, when it fits there).

Per piece, in order: its first trained turn with the least context that fits, up to the turn's own prompt (the
messages back to the previous assistant turn, a tool call with its results); then as many of the following trained
turns as fit with that prompt; then the earliest start that still fits; the last piece also takes the messages
after the last trained turn when they fit. Each choice is a search over token counts of real tokenizations
(steps of 1, 2, 4, ... messages, then bisection: the pieces tried stay near a row's length; each text is encoded
once: ``known``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from packsft.layout import conversation_cost
from packsft.prompt_formats import PromptFormatError, Tokenization, tokenize_conversation, trained_turns


class Split(NamedTuple):
    """What :func:`split_conversation` made of one conversation.

    Attributes:
        pieces: ``(conversation, tokens, runs, start)`` per piece, in order: the stored conversation (same
            ``tools``, ``path``, ``line``), its ``tokenize_conversation(..., runs=True)`` and the index of its
            second message (the first after the system message) in the whole conversation.
        rejected: ``(turn, tokens, error)`` per trained assistant turn that no piece trains: its message index,
            the tokens of the system message with it (``None`` when it does not render alone) and the
            :class:`PromptFormatError` that says why.
    """

    pieces: list[tuple[Any, list[int], list[int], int]]
    rejected: list[tuple[int, int | None, PromptFormatError]]


def split_conversation(conv, tokenization: Tokenization, max_seq_len: int, context_parallel_size: int = 1,
                       train_on: str = "all", known: dict[str, list[int]] | None = None) -> Split:
    """Cut ``conv`` (a :class:`packsft.conversation.Conversation`) into pieces of cost at most ``max_seq_len``.

    Args:
        tokenization: the packer's tokenization (a per-turn format: ``chat-template`` or ``passthrough``).
        context_parallel_size: pieces cost ``conversation_cost(n, cp)`` tokens.
        train_on: the prompt format's ``train_on``: which assistant turns the whole conversation trains.
        known: segment texts' ids already encoded (``known`` of :func:`tokenize_conversation`), extended here.

    Returns:
        The :class:`Split`; no pieces when the conversation trains nothing or every trained turn is rejected.
    """
    msgs = conv.messages
    turns = trained_turns(msgs, train_on)
    trained = set(turns)
    starts = [i for i in range(1, len(msgs)) if msgs[i]["role"] != "tool"]  # where a piece's messages may start
    known = {} if known is None else known
    tried: dict[tuple[int, int, int, int], Any] = {}

    def piece(s: int, e: int, k: int, j: int):
        """``(messages, tokens, runs)`` of the piece ``messages[s : e + 1]`` training ``turns[k : j + 1]``, or the
        :class:`PromptFormatError` it raised."""
        key = (s, e, k, j)
        if key not in tried:
            own = set(turns[k : j + 1])
            body = [{**m, "weight": 0} if i in trained and i not in own else m
                    for i, m in enumerate(msgs[s : e + 1], s)]
            try:
                tokens, runs = tokenize_conversation([msgs[0], *body], tokenization, conv.tools,
                                                     conv.chat_template_kwargs, known, runs=True)
            except PromptFormatError as err:
                tried[key] = err
            else:
                tried[key] = ([msgs[0], *body], tokens, runs)
        return tried[key]

    def fits(s: int, e: int, k: int, j: int) -> bool:
        got = piece(s, e, k, j)
        return not isinstance(got, PromptFormatError) and \
            conversation_cost(len(got[1]), context_parallel_size) <= max_seq_len

    pieces, rejected = [], []
    last = len(msgs) - 1
    k = 0
    while k < len(turns):
        f = turns[k]
        if not fits(f, f, k, k):
            got = piece(f, f, k, k)
            if isinstance(got, PromptFormatError):
                rejected.append((f, None, got))
            else:
                n = len(got[1])
                rejected.append((f, n, PromptFormatError(
                    f"assistant turn of {n} tokens with the system message (cost "
                    f"{conversation_cost(n, context_parallel_size)}) does not fit in max_seq_len {max_seq_len}: "
                    "--oversize split cuts only between turns", f)))
            k += 1
            continue
        prompt = f  # the turn's own prompt: back to the previous assistant turn, or to the call of its tool results
        while prompt > 1 and msgs[prompt - 1]["role"] != "assistant":
            prompt -= 1
        if msgs[prompt]["role"] == "tool":
            prompt -= 1
        near = [s for s in starts if prompt <= s <= f]
        base = near[_first_true(near, lambda s, f=f, k=k: fits(s, f, k, k))]
        j = _last_true(k, len(turns) - 1, lambda j, b=base, k=k: fits(b, turns[j], k, j))
        e = turns[j]
        before = [s for s in starts if s <= base]
        s = before[_first_true(before, lambda s, e=e, k=k, j=j: fits(s, e, k, j))]
        if j == len(turns) - 1 and e < last and fits(s, last, k, j):
            e = last
        messages, tokens, runs = piece(s, e, k, j)
        pieces.append((dataclasses.replace(conv, messages=messages), tokens, runs, s))
        k = j + 1
    return Split(pieces, rejected)


def _first_true(xs: list[int], ok: Callable[[int], bool]) -> int:
    """The smallest index ``i`` of ``xs`` with ``ok(xs[i])``, given that ``ok(xs[-1])`` holds: steps of 1, 2, 4, ...
    back from the end until one fails, then bisection (so the pieces tried stay near a row's length). The index
    returned always passed ``ok``, even where ``ok`` is not monotone."""
    good, lo, step = len(xs) - 1, 0, 1
    while good > lo:
        x = max(good - step, lo)
        if not ok(xs[x]):
            lo = x + 1
            break
        good, step = x, 2 * step
    while lo < good:
        mid = (lo + good) // 2
        if ok(xs[mid]):
            good = mid
        else:
            lo = mid + 1
    return good


def _last_true(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)``, given that ``ok(lo)`` holds (as :func:`_first_true`,
    galloping up from ``lo``)."""
    good, step = lo, 1
    while good < hi:
        x = min(good + step, hi)
        if not ok(x):
            hi = x - 1
            break
        good, step = x, 2 * step
    while good < hi:
        mid = (good + hi + 1) // 2
        if ok(mid):
            good = mid
        else:
            hi = mid - 1
    return good

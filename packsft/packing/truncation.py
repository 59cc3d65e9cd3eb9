"""Own-row truncation: a conversation longer than ``max_seq_len`` (``--oversize own-row``) is cut by the worker to
:func:`own_row_window` tokens before it is counted; the loader then truncates its row to ``max_seq_len``."""

from __future__ import annotations

from typing import Any

from packsft.packing.config import PackConfig
from packsft.prompt_formats import PromptFormatError, Tokenization, tokenize_conversation
from packsft.record_formats import ROW_JSON


def own_row_window(max_seq_len: int) -> tuple[int, int]:
    """Token counts ``(low, high)`` an own-row conversation is cut to by the packer: ``L + 8 .. L + margin``.

    ``margin = max(32, L // 16)``. At least 8 tokens beyond ``L`` stay so that the loader's truncation, not
    the template's end of turn after a cut message, ends the row (the model is not taught to stop mid-text).
    """
    return max_seq_len + 8, max_seq_len + max(32, max_seq_len // 16)


def _message_chars(m: dict[str, Any]) -> int:
    return len(ROW_JSON(m))


def _content_chars(m: dict[str, Any]) -> int:
    """At most :func:`_message_chars`: the string content's length (no JSON for a plain text message)."""
    content = m.get("content")
    if isinstance(content, str) and "tool_calls" not in m:
        return len(content)
    return _message_chars(m)


def _cut_messages(messages: list[dict[str, Any]], budget: int, train_on: str,
                  sizes: list[int] | None = None) -> tuple[list[dict[str, Any]], bool]:
    """The longest prefix of ``messages`` within ``budget`` JSON characters, the last kept content cut short.

    At least the system message and one more are kept. A message whose string content does not fit is kept
    with a prefix of its content (never emptied); one that cannot be cut so (or an assistant turn with
    ``tool_calls``, which templates render after the content) is dropped with all after it. With
    ``train_on == "last"`` and the last assistant turn dropped, the kept assistant turns get ``weight: 0``
    (what the loader's truncation of the whole conversation would have trained: nothing of them).

    Args:
        sizes: ``_message_chars`` of each message, when known.

    Returns:
        ``(messages, cut)``: new message dicts; ``cut`` is False when all of ``messages`` fit.
    """
    kept: list[dict[str, Any]] = []
    left = budget
    for i, m in enumerate(messages):
        size = sizes[i] if sizes is not None else _message_chars(m)
        if size <= left:
            kept.append(m)
            left -= size
            continue
        content = m.get("content")
        # an assistant turn's tool calls are rendered after its content: a cut content would be followed by them
        # in the row, a reply the assistant never gave, so such a turn is kept whole or dropped, never cut
        cuttable = isinstance(content, str) and not m.get("tool_calls")
        room = left - (size - len(content)) if cuttable else 0
        if i == 0:  # the system message: cut (possibly to ""), then keep one more
            kept.append({**m, "content": content[:max(room, 0)]} if isinstance(content, str) else m)
            left = 0
            continue
        if room > 0 and content[:room].strip():
            kept.append({**m, "content": content[:room]})
        elif len(kept) < 2 and i >= 1:  # keep one non-system message whatever it costs
            kept.append({**m, "content": content[:max(room, 1)]} if cuttable and content else m)
        break
    else:
        return list(messages), False
    if train_on == "last":
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        if last >= len(kept):
            kept = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in kept]
    return kept, True


def tokenize_record(conv, tok, fmt, cfg: PackConfig, first=None, known=None):
    """``(conv, tokens, runs, cut, uncut)``: ``conv`` tokenized with ``fmt`` (own-row: cut to its window first),
    its targets as runs (``tokenize_conversation(..., runs=True)``), and ``uncut``: ``(tokens, exact)``, the
    length of the conversation as given, before any cut (:func:`_fit_own_row`).

    ``first``: when already computed (:func:`process_lines`, where :func:`tokenized_whole` is true), the
    result of ``tokenize_conversation(..., runs=True)`` on the whole ``conv`` with ``fmt``, or the error it
    raised; ``known``: the ids of its segment texts (``known`` of ``tokenize_conversation``), reused by the cuts.
    """
    cut = False
    if cfg.oversize == "own-row":
        msgs, tokens, runs, cut, uncut = _fit_own_row(conv, tok, fmt, cfg, first, known)
        if cut:
            conv = type(conv)(messages=msgs, tools=conv.tools, path=conv.path, line=conv.line,
                              meta=conv.meta, chat_template_kwargs=conv.chat_template_kwargs)
    else:
        tokens, runs = _whole(conv, tok, fmt, first)
        uncut = (len(tokens), True)
    return conv, tokens, runs, cut, uncut


def _whole(conv, tok, fmt, first=None, known=None):
    """``tokenize_conversation(..., runs=True)`` of the whole ``conv``: ``first`` when given (raised when an error)."""
    if first is None:
        return tokenize_conversation(conv.messages, Tokenization.of(tok, fmt), conv.tools, conv.chat_template_kwargs,
                                     known, runs=True)
    if isinstance(first, PromptFormatError):
        raise first
    return first


def tokenized_whole(conv, cfg: PackConfig) -> bool:
    """Whether :func:`tokenize_record` starts by tokenizing the whole ``conv`` (own-row: unless it is long)."""
    return cfg.oversize != "own-row" or \
        sum(map(_content_chars, conv.messages)) <= 8 * own_row_window(cfg.max_seq_len)[1]


def _fit_own_row(conv, tok, fmt, cfg: PackConfig, first=None, known=None):
    """Tokenize ``conv``, cutting it (:func:`_cut_messages`) into :func:`own_row_window` when it is longer.

    A conversation whose contents have at most ``8 * high`` characters is first tokenized whole (kept when it
    fits). Work is bounded by a few tokenizations of about ``L`` tokens, whatever the conversation's length:
    the character budget starts at ``8 * high`` and is doubled, then bisected (with a proportional guess).
    Each try renders the cut conversation but encodes only the segment texts not encoded before (``known``):
    with ``chat-template`` and ``passthrough`` mostly the segment the cut falls in (the presets also encode
    each try's whole text).

    Args:
        first, known: as in :func:`tokenize_record`.

    Returns:
        ``(messages, tokens, runs, cut, uncut)``: the messages to store and their tokenization (targets as
        runs); ``uncut = (n, exact)``: the whole conversation's tokens, or (``exact`` false: it was not
        tokenized whole) an estimate, the stored tokens scaled by the characters of all the messages over
        those of the stored ones.

    Raises:
        PromptFormatError: the conversation (or every cut of it tried) does not tokenize.
    """
    low, high = own_row_window(cfg.max_seq_len)
    known = {} if known is None else known  # each segment text's ids: a cut encodes only the texts it changed
    whole = None  # the uncut conversation's (tokens, runs), once known
    if first is not None or tokenized_whole(conv, cfg):  # most conversations: tokenized whole, once
        whole = _whole(conv, tok, fmt, first, known)
        if len(whole[0]) <= high:
            return conv.messages, *whole, False, (len(whole[0]), True)
    sizes = [_message_chars(m) for m in conv.messages]
    total = sum(sizes)

    def done(msgs, tokens, runs, cut):
        if whole is not None:
            return msgs, tokens, runs, cut, (len(whole[0]), True)
        kept = sum(map(_message_chars, msgs)) if cut else total
        return msgs, tokens, runs, cut, (max(len(tokens), round(len(tokens) * total / max(1, kept))), not cut)

    budget = min(total, 8 * high)
    lo, hi = 0, None  # budgets known to give fewer than `low` tokens / more than `high`
    best = None  # the smallest cut seen above `low` (used if the window is never hit)
    error = None
    for _ in range(24):
        msgs, cut = _cut_messages(conv.messages, budget, cfg.train_on, sizes)
        try:
            tokens, runs = whole if whole is not None and not cut else \
                tokenize_conversation(msgs, Tokenization.of(tok, fmt), conv.tools, conv.chat_template_kwargs, known,
                                      runs=True)
        except PromptFormatError as e:  # a cut the format cannot render: try a shorter one
            if not cut:
                raise
            error, hi, n = e, budget, None
        else:
            n = len(tokens)
            if not cut and n <= high:
                return done(msgs, tokens, runs, False)
            if low <= n <= high:
                return done(msgs, tokens, runs, True)
            if n > high:
                hi = budget
                if best is None or n < len(best[1]):
                    best = (msgs, tokens, runs, cut)
            else:
                lo = budget
        if hi is None:
            guess = budget * 2 if not n else max(budget * 2, int(budget * high / n))
            budget = min(total, guess)
        else:
            guess = int(budget * (low + high) / 2 / n) if n else (lo + hi) // 2
            budget = guess if lo < guess < hi else (lo + hi) // 2
        if hi is not None and hi - lo <= 1:
            break
    if best is not None:
        return done(*best)
    raise error or PromptFormatError("the conversation could not be cut to max_seq_len")



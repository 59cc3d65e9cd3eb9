"""One conversation -> ``(tokens, targets)``: rendering to segments, encoding, targets; one batch at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from packsft.layout import IGNORE_INDEX
from packsft.prompt_formats.base import PromptFormat, PromptFormatError, Segment

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from packsft.prompt_formats.spec import Tokenization


def render_segments(messages, tools, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[Segment]:
    """Render a conversation into text segments with their training flags (no tokenization).

    Args:
        messages: the conversation's messages (first one ``system``).
        tools: its OpenAI function schemas or ``None`` (used by ``chat-template`` only).
        tokenizer, fmt: the tokenizer and the prompt format bound to it.
        chat_template_kwargs: this conversation's ``apply_chat_template`` keyword arguments (over the
            format's own).

    Returns:
        Segments whose texts concatenate to the whole rendering. For ``chat-template`` and ``passthrough``
        they alternate prompt, trained, prompt, ..., prompt (possibly empty texts); each is tokenized alone.

    Raises:
        PromptFormatError: every assistant turn empty, template failure, or a turn that cannot be located.
        NonMegatronError: (presets, unless the format allows non-Megatron) an assistant turn that does not follow
            a user or tool turn.
    """
    return fmt.segments(messages, tools, tokenizer, chat_template_kwargs)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (no special tokens added).

    Raises:
        PromptFormatError: a text holds a lone UTF-16 surrogate, which no tokenizer encodes (the Rust
            tokenizer raises ``TypeError``); it comes from a ``\\ud800``-style escape inside a JSON string that is
            decoded again (tool-call ``arguments``, ShareGPT ``function_call`` values), the line's own strings
            being checked when it is read.
    """
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch  # the same ids, no offsets
    try:
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    except TypeError:
        bad = next((c for t in texts for c in t if "\ud800" <= c <= "\udfff"), None)
        if bad is None:
            raise
        raise PromptFormatError(f"the rendered text holds a lone UTF-16 surrogate (U+{ord(bad):04X}, from a \\u "
                                "escape, e.g. in tool-call arguments given as a JSON string), which is not "
                                "text") from None


def _encode_distinct(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """:func:`_encode` of ``texts``, each distinct text encoded once (a template's text after every last turn,
    e.g. ``"\\n"``, or a frequent short user turn, comes once per conversation of a batch: a third of the texts
    of a two-turn dataset). Equal texts get the same list: do not change them in place."""
    distinct = dict.fromkeys(texts)
    if len(distinct) == len(texts):
        return _encode(tokenizer, texts) if texts else []
    ids = dict(zip(distinct, _encode(tokenizer, list(distinct))))
    return [ids[t] for t in texts]


def tokenize_segments(
    messages: list[dict[str, Any]],
    tokenization: Tokenization,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    known: dict[str, list[int]] | None = None,
) -> list[tuple[Segment, list[int]]]:
    """Each rendered segment with its token ids, in order (their concatenation is the conversation).

    ``chat-template`` and ``passthrough`` encode every segment on its own (prompt parts through the
    assistant header, then each trained assistant turn, plus EOS when the format's ``append_eos``): no token crosses
    a header and a reply. The presets encode the whole rendering and check that every segment's own tokens
    equal its slice (Megatron-LM tokenizes the whole string and asserts this); with
    the format's ``allow_non_megatron`` a conversation that fails the check gets each segment's own tokens instead.

    Segments with equal texts get the same list of ids (each distinct text is encoded once), as do those
    taken from ``known``: do not change the pieces in place.

    Args:
        tokenization: as in :func:`tokenize_conversation`.
        known: text -> ids of segment texts already encoded (each is encoded alone), taken from it and extended
            with the new ones, so that tokenizing variants of one conversation (the packer's own-row cuts)
            encodes each segment text once (the presets also encode their whole text each time).

    Raises:
        PromptFormatError: as :func:`render_segments`.
        NonMegatronError: (presets, unless the format allows non-Megatron) a token that crosses a turn boundary
            (names the message and the text on both sides), or an assistant turn not after a user/tool turn.
    """
    got = _segments_batch([(messages, tools, chat_template_kwargs)], tokenization.tokenizer, tokenization.fmt,
                          [known])[0]
    if isinstance(got, PromptFormatError):
        raise got
    return got


def _segments_batch(conversations, tokenizer, fmt: PromptFormat, known: list | None = None) -> list:
    """:func:`tokenize_segments` of each ``(messages, tools, chat_template_kwargs)``, stage by stage over the
    batch (render all, one encode call for all their new texts, then each one's pieces); per conversation its
    result or the :class:`PromptFormatError` it raised. ``known``: per conversation ``None`` or its own dict
    (as in :func:`tokenize_segments`); the presets' whole text, which a cut always changes, is not kept."""
    whole = fmt.whole_texts  # texts before the segments' own
    out: list = []
    staged = []  # (index into out, segments, texts, dict, number of them encoded)
    todo: list[str] = []
    for (messages, tools, kwargs), memo in zip(conversations, known or [None] * len(conversations), strict=True):
        try:
            segments, own = fmt.texts(render_segments(messages, tools, tokenizer, fmt, kwargs))
        except PromptFormatError as e:
            out.append(e)
            continue
        new = own[:whole] + [t for t in own[whole:] if t not in memo] if memo else own
        staged.append((len(out), segments, own, memo, len(new)))
        out.append(None)
        todo += new
    try:
        encoded = _encode_distinct(tokenizer, todo)
    except PromptFormatError:  # a text no tokenizer encodes: each conversation's own texts, to find whose
        encoded = None
    pos = 0
    for i, segments, own, memo, n in staged:
        try:
            ids = encoded[pos : pos + n] if encoded is not None else _encode(tokenizer, todo[pos : pos + n])
            if memo:  # (each conversation's own dict: as it was when its new texts were chosen)
                fresh = iter(ids)
                ids = [*(next(fresh) for _ in own[:whole]),
                       *(memo[t] if t in memo else next(fresh) for t in own[whole:])]
            if memo is not None:
                memo.update(zip(own[whole:], ids[whole:]))
            out[i] = fmt.assemble(segments, ids, tokenizer)
        except PromptFormatError as e:
            out[i] = e
        pos += n
    return out


def _target_runs(pairs: list[tuple[Segment, list[int]]]) -> tuple[list[int], list[int]]:
    """``(tokens, runs)`` of :func:`tokenize_segments`' result: ``runs`` cover ``tokens`` in order, ``+k`` for
    ``k`` trained tokens (their targets are the tokens), ``-k`` for ``k`` masked ones (:data:`IGNORE_INDEX`).

    Raises:
        PromptFormatError: no tokens.
    """
    tokens: list[int] = []
    runs: list[int] = []
    for seg, piece in pairs:
        tokens += piece
        k = min(seg.masked_prefix, len(piece)) if seg.trained else len(piece)
        if k:
            runs.append(-k)
        if len(piece) > k:
            runs.append(len(piece) - k)
    if not tokens:
        raise PromptFormatError("the conversation renders to no tokens")
    return tokens, runs


def targets_of_runs(tokens: list[int], runs: list[int]) -> list[int]:
    """The targets list of ``tokens`` and their runs (as :func:`tokenize_conversations` returns them with
    ``runs=True``): each token where its run is trained, else :data:`IGNORE_INDEX`."""
    targets: list[int] = []
    pos = 0
    for r in runs:
        targets += tokens[pos : pos + r] if r > 0 else [IGNORE_INDEX] * -r
        pos += abs(r)
    return targets


def _targets(pairs: list[tuple[Segment, list[int]]]) -> tuple[list[int], list[int]]:
    """``(tokens, targets)`` of :func:`tokenize_segments`' result (see :func:`tokenize_conversation`)."""
    tokens, runs = _target_runs(pairs)
    return tokens, targets_of_runs(tokens, runs)


def tokenize_conversation(
    messages: list[dict[str, Any]],
    tokenization: Tokenization,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    known: dict[str, list[int]] | None = None,
    runs: bool = False,
) -> tuple[list[int], list[int]]:
    """Tokenize one conversation and build its targets (Megatron-LM ``SFTTokenizer.tokenize_conversation``).

    Args:
        messages: the conversation (first message ``system``); assistant turns may carry ``"weight": 0|1``.
        tokenization: the tokenizer and the prompt format bound to it (:meth:`TokenizationSpec.resolve
            <packsft.prompt_formats.TokenizationSpec.resolve>`, or :meth:`Tokenization.of
            <packsft.prompt_formats.Tokenization.of>` of a bound format).
        tools: the conversation's tool schemas (``chat-template`` renders them).
        chat_template_kwargs: this conversation's ``apply_chat_template`` keyword arguments.
        known: as in :func:`tokenize_segments`.
        runs: give the targets as runs, ``(tokens, runs)`` (as :func:`tokenize_conversations`).

    Returns:
        ``(tokens, targets)``: two equally long lists of int token ids; ``targets[i]`` is ``tokens[i]`` where
        trained, else :data:`IGNORE_INDEX`. No BOS/EOS is added beyond what the format renders, except the
        EOS of the format's ``append_eos``.

    Raises:
        PromptFormatError: the conversation cannot be rendered, renders to no token, or (presets) a token
            crosses a turn boundary (the error names the message and the text on both sides).
    """
    pairs = tokenize_segments(messages, tokenization, tools, chat_template_kwargs, known)
    return _target_runs(pairs) if runs else _targets(pairs)


def tokenize_conversations(
    conversations: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None]],
    tokenization: Tokenization,
    known: list[dict[str, list[int]] | None] | None = None,
    runs: bool = False,
) -> list[tuple[list[int], list[int]] | PromptFormatError]:
    """:func:`tokenize_conversation` of each ``(messages, tools, chat_template_kwargs)``, the same results.

    Each stage runs over the whole batch (render all, one encode call for all their texts, then the targets):
    the packer's hot loop, faster than one conversation at a time as each stage's code and data stay in cache
    (``bench/pack.py``).

    Args:
        tokenization: as in :func:`tokenize_conversation`.
        known: per conversation, ``None`` or its own dict as ``known`` in :func:`tokenize_segments` (distinct
            dicts): the packer keeps each conversation's segment ids, so that cutting it does not encode its
            kept turns again.
        runs: give each conversation's targets as runs, ``(tokens, runs)``: ``+k`` for ``k`` trained tokens,
            ``-k`` for ``k`` masked ones, in order (:func:`targets_of_runs` makes the list; the packer's token
            cache makes them in numpy).

    Returns:
        Per conversation, its ``(tokens, targets)`` (or ``(tokens, runs)``) or the :class:`PromptFormatError`
        it raised.
    """
    out: list = []
    finish = _target_runs if runs else _targets
    for got in _segments_batch(conversations, tokenization.tokenizer, tokenization.fmt, known):
        try:
            out.append(got if isinstance(got, PromptFormatError) else finish(got))
        except PromptFormatError as e:  # renders to no tokens
            out.append(e)
    return out


def count_conversation_tokens(
    messages: list[dict[str, Any]],
    tokenization: Tokenization,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> int:
    """Number of tokens of a conversation: ``len(tokenize_conversation(...)[0])``.

    The packer's token counter; it runs the loader's own tokenization (including the masking checks),
    so a conversation that would fail in the loader fails here, at packing time.

    Raises:
        PromptFormatError: as :func:`tokenize_conversation`.
    """
    return len(tokenize_conversation(messages, tokenization, tools, chat_template_kwargs)[0])

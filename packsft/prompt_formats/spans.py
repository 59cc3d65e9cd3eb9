"""Span and turn masking: which assistant turns are trained and where they lie in a rendered conversation.

A span is ``[start, end)`` in the whole rendering: an assistant content with the template's end-of-turn text.
It is found from one rendering with marked contents (:func:`marked_spans`) or, turn by turn, from renderings of
each turn's own prefix (:func:`turn_spans`); the segments alternate prompt and trained text
(:func:`segments_from_spans`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from packsft.prompt_formats.base import PromptFormatError, Segment
from packsft.prompt_formats.template import CLOSE, OPEN, render_many

if TYPE_CHECKING:
    from packsft.prompt_formats.base import PromptFormat
    from packsft.prompt_formats.template import TemplateShape


def trained_turns(messages: list[dict[str, Any]], train_on: str = "all") -> list[int]:
    """Indices of the assistant turns a conversation trains (``chat-template`` and ``passthrough``).

    An assistant turn is trained unless it has ``"weight": 0``, it is empty (no content but whitespace
    and no ``tool_calls``), or ``train_on == "last"`` and it is not the conversation's last assistant turn.
    """
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last":
        assistants = assistants[-1:]
    return [i for i in assistants if messages[i].get("weight", 1) != 0
            and ((messages[i].get("content") or "").strip() or messages[i].get("tool_calls"))]


def check_masks(messages: list[dict[str, Any]]) -> None:
    """Raise :class:`PromptFormatError` when every assistant turn is empty (nothing to train)."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if assistants and all(not (messages[i].get("content") or "").strip() and not messages[i].get("tool_calls")
                          for i in assistants):
        raise PromptFormatError("empty assistant turn (no assistant turn has content, nothing to train)",
                                assistants[0])


def marked_spans(turns, full: str, marked: str, eot: str, derived: bool = False) -> list[tuple[int, int]] | None:
    """Assistant spans ``[start, end)`` in ``full`` from a rendering whose assistant contents carry markers.

    Returns ``None`` (use the per-turn path) unless removing the markers gives exactly ``full`` (not checked
    when ``derived``: ``full`` was made so), every turn has exactly one pair of markers, and the end-of-turn
    text follows each content.
    """
    if marked.count(OPEN) != len(turns) or (not derived and marked.replace(OPEN, "").replace(CLOSE, "") != full):
        return None
    spans, removed, pos = [], 0, 0
    for _ in turns:
        o = marked.index(OPEN, pos)
        c = marked.index(CLOSE, o)
        if OPEN in marked[o + 1 : c]:
            return None
        start, content_end = o - removed, c - removed - 1
        removed += 2
        pos = c + 1
        if not full.startswith(eot, content_end):
            return None
        spans.append((start, content_end + len(eot)))
    return spans


def header_checked(spans, full: str, shape: TemplateShape):
    """``spans``, or ``None`` when a turn is not rendered right after the generation prompt (located turn by turn)."""
    if spans is not None and shape.header and not all(full.endswith(shape.header, 0, s) for s, _ in spans):
        return None
    return spans


def _sentinel(message: dict[str, Any]) -> str:
    """A private-use character that ``message``'s content does not hold: the probe turn of :func:`turn_spans`
    (one the content starts with would extend the common prefix into the content)."""
    text = str(message.get("content"))
    return next((chr(c) for c in range(0xE000, 0xE040) if chr(c) not in text), OPEN)


def turn_spans(msgs, tools, tokenizer, fmt: PromptFormat, kwargs, turns, full: str,
               shape: TemplateShape) -> list[tuple[int, int]]:
    """Assistant spans ``[start, end)`` in ``full``, each located from renderings of its own prefix.

    Turn ``i`` ends where ``render(messages[:i + 1])`` ends (trailing whitespace removed) and starts where
    ``render(messages[:i], add_generation_prompt=True)`` ends; when the template renders the prompt
    differently once the turn follows (Mistral's moves the system prompt to the last user turn), it starts
    where that rendering first differs from one whose turn ``i`` is a sentinel character. It starts there too
    when that point lies further on and right after the generation header (the message renders its own role
    marker after an empty generation prompt: the marker is masked, as :func:`marked_spans` masks it). When the
    rendering is a prefix of ``full`` the span is taken as is; otherwise (templates that place tools before the
    *last* user turn) the trained text is searched in ``full`` after the previous span and must follow the same
    prompt ending.

    Raises:
        PromptFormatError: a turn that does not start after the template's generation header, or whose
            trained text cannot be found in the whole rendering.
    """
    n = len(turns)
    probes = [msgs[:i] + [{"role": "assistant", "content": _sentinel(msgs[i])}] for i in turns]
    texts = render_many(tokenizer, fmt, [msgs[: i + 1] for i in turns] + probes, tools, kwargs)
    gens = render_many(tokenizer, fmt, [msgs[:i] for i in turns], tools, kwargs, generation_prompt=True)
    spans, done = [], 0
    for k, i in enumerate(turns):
        end_text, probe, gen = texts[k], texts[n + k], gens[k]
        content = len(os.path.commonprefix([end_text, probe]))  # where the turn's own text starts to differ
        own = len(gen) if end_text.startswith(gen) else content
        if content > own and end_text.endswith(shape.header or "", 0, content):
            own = content  # text the message renders before its content (a role marker after an empty generation
            # prompt) is masked, as the marker path masks it: the same spans with and without tool calls
        if shape.header and not end_text.endswith(shape.header, 0, own):
            raise PromptFormatError(
                f"assistant turn does not follow the template's generation header {shape.header!r} (it is rendered "
                f"after {end_text[max(0, own - 40):own]!r}), so the prompt the model sees when it generates this "
                "turn is not the one it would be trained on", i)
        trained = end_text[own:].rstrip()
        if full.startswith(end_text.rstrip()) and own >= done:
            start = own
        else:
            start = full.find(trained, done) if trained else -1
            tail = end_text[max(0, own - 8):own]
            if start < 0 or not full.endswith(tail, 0, start):
                raise PromptFormatError(
                    f"assistant turn {trained[:40]!r} rendered after its own prefix is not found in the whole "
                    f"conversation after {tail!r}; the template renders it differently in context", i)
        spans.append((start, start + len(trained)))
        done = start + len(trained)
    return spans


def segments_from_spans(full: str, turns, spans, last: int) -> list[Segment]:
    """``full`` cut at the spans: prompt, trained, ..., prompt (the last prompt belongs to message ``last``).

    Raises:
        PromptFormatError: two spans overlap.
    """
    segments: list[Segment] = []
    done = 0  # characters of `full` already assigned to segments
    for i, (start, end) in zip(turns, spans):
        if start < done:
            raise PromptFormatError("assistant turns overlap in the rendering", i)
        segments.append(Segment(full[done:start], i, False))
        segments.append(Segment(full[start:end], i, True))
        done = end
    segments.append(Segment(full[done:], last, False))
    return segments

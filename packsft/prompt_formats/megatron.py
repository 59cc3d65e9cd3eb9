"""The Megatron-LM presets: ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned``.

As Megatron-LM's ``SFTTokenizer`` (used by NeMo RL's ``megatron_sft_packed``) they tokenize the whole rendering
and refuse (:class:`NonMegatronError`) what it refuses: a turn whose own tokens are not its slice of the whole,
an assistant turn that does not follow a user or tool turn. With ``allow_non_megatron`` such a conversation is
kept instead (each turn then encoded on its own: packsft-only). None adds BOS or EOS; a ``tool`` turn renders to
nothing in the Nemotron presets, and an assistant turn that only carries ``tool_calls`` is an error.
"""

from __future__ import annotations

from typing import Any, ClassVar

from packsft.prompt_formats.base import NonMegatronError, PromptFormat, PromptFormatError, Segment

_MEGATRON_HINT = ("Megatron-LM's SFTTokenizer refuses this conversation ({}), so it would crash Megatron-LM --sft "
                  "and NeMo RL megatron_sft_packed; --allow-non-megatron keeps it (the file is then packsft-only)")


def _strip_think(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "")


def _nemotron_segments(messages: list[dict[str, Any]], name: str) -> list[Segment]:
    """``nemotron-nano-v2`` or ``nemotron-h-aligned`` (``name``) segments of a conversation."""
    nano = name == "nemotron-nano-v2"
    segments = []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            body = _strip_think(content) if nano else content
            segments.append(Segment(f"<SPECIAL_10>System\n{body.strip()}\n", i, False))
        elif role == "user":
            body = (_strip_think(content) if nano else content).strip()
            tail = "\n" if nano else "\n<SPECIAL_11>Assistant\n"
            segments.append(Segment(f"<SPECIAL_11>User\n{body}{tail}", i, False))
        elif role == "assistant":
            if nano:
                segments.append(Segment(f"<SPECIAL_11>Assistant\n{content.strip()}\n<SPECIAL_12>\n", i, True, 3))
            else:
                segments.append(Segment(f"{content.strip()}\n", i, True))
        # tool turns render to nothing in the Nemotron presets
    return segments


def _identity_segments(messages: list[dict[str, Any]]) -> list[Segment]:
    """Megatron-LM's ``identity``: every content verbatim; system, user and tool turns masked."""
    return [Segment(m.get("content") or "", i, m["role"] == "assistant") for i, m in enumerate(messages)]


def _check_megatron_order(messages: list[dict[str, Any]]) -> None:
    """Raise :class:`NonMegatronError` for an assistant turn not right after a user or tool turn.

    Megatron-LM asserts ``conversation[i - 1]["role"] in ("user", "tool")`` for every assistant turn ``i``.
    """
    for i, m in enumerate(messages):
        prev = messages[i - 1]["role"]
        if m["role"] == "assistant" and prev not in ("user", "tool"):
            raise NonMegatronError(f"assistant turn follows a {prev!r} turn, not a user or tool turn; "
                                   + _MEGATRON_HINT.format("AssertionError"), i)


def _boundary_error(tokenizer, segments: list[Segment], pieces, tokens, k: int, pos: int) -> PromptFormatError:
    """The error for segment ``k`` whose own tokens differ from its slice ``tokens[pos:...]``."""
    piece, got = pieces[k], tokens[pos : pos + len(pieces[k])]
    first = next((j for j, (a, b) in enumerate(zip(piece, got)) if a != b), min(len(piece), len(got)))
    at_start = first == 0 and k > 0
    left = segments[k - 1] if at_start else segments[k]
    right = segments[k] if at_start else (segments[k + 1] if k + 1 < len(segments) else None)
    straddling = tokenizer.decode(got[first : first + 1]) if first < len(got) else ""
    message_index = right.turn if right is not None and right.turn >= 0 else left.turn
    right_text = right.text[:40] if right is not None else ""
    return NonMegatronError(
        f"a token crosses the boundary between {left.text[-40:]!r} and {right_text!r} (token {straddling!r} of "
        f"the whole conversation spans both sides); the prompt format cannot mask this turn exactly; "
        + _MEGATRON_HINT.format("AssertionError: expected turn tokens to match tokens in conversation"),
        message_index)


class MegatronPreset(PromptFormat):
    """A Megatron-LM preset: system, user and tool turns masked, the whole rendering encoded at once."""

    preset_pad = "<unk>"
    megatron = True
    whole_texts = 1
    tool_calls_hint: ClassVar[str] = "the Nemotron presets do not render tool_calls; use chat-template"
    """Why an assistant turn with only ``tool_calls`` is empty (in the error)."""

    def render(self, messages: list[dict[str, Any]]) -> list[Segment]:
        """The preset's segments of a conversation."""
        return _nemotron_segments(messages, self.name)

    def segments(self, messages, tools, tokenizer, chat_template_kwargs=None):
        """Refuse ``weight: 0`` and empty assistant turns, render, and (unless :attr:`allow_non_megatron`) refuse
        Megatron-LM's order errors."""
        for i, m in enumerate(messages):
            if m.get("weight", 1) == 0:
                raise PromptFormatError(f"'weight: 0' needs prompt format chat-template or passthrough; {self.name} "
                                        "masks as Megatron-LM does", i)
            if m["role"] == "assistant" and not (m.get("content") or "").strip():
                why = f" ({self.tool_calls_hint})" if m.get("tool_calls") else ""
                raise PromptFormatError(f"empty assistant turn{why}", i)
        segments = self.render(messages)
        if not self.allow_non_megatron:
            _check_megatron_order(messages)
        return segments

    def texts(self, segments):
        """The whole text, then each non-empty segment's."""
        segments = [s for s in segments if s.text]
        return segments, ["".join(s.text for s in segments)] + [s.text for s in segments]

    def assemble(self, segments, encoded, tokenizer):
        """Each segment with its own ids, checked to be its slice of the whole text's ids (as Megatron-LM).

        Raises:
            NonMegatronError: (unless :attr:`allow_non_megatron`) a token crosses a segment boundary, or the
                segments' tokens do not cover the whole.
        """
        tokens, pieces = encoded[0], encoded[1:]
        pos = 0
        for k, piece in enumerate(pieces):
            if tokens[pos : pos + len(piece)] != piece:
                if self.allow_non_megatron:
                    break  # packsft-only: every turn encoded on its own
                raise _boundary_error(tokenizer, segments, pieces, tokens, k, pos)
            pos += len(piece)
        else:
            if pos != len(tokens) and not self.allow_non_megatron:
                raise NonMegatronError(f"turns cover {pos} tokens but the conversation has {len(tokens)}; "
                                       + _MEGATRON_HINT.format("AssertionError: mismatch in target masking"))
        return list(zip(segments, pieces))


class Identity(MegatronPreset):
    """``identity``: every content verbatim (an assistant turn without content is an error)."""

    tool_calls_hint = "identity does not render tool_calls; use chat-template"

    def render(self, messages):
        """Each message's content, verbatim."""
        return _identity_segments(messages)


class NemotronNanoV2(MegatronPreset):
    """``nemotron-nano-v2``: role headers, ``/think`` and ``/no_think`` deleted, assistant header tokens masked."""


class NemotronHAligned(MegatronPreset):
    """``nemotron-h-aligned``: role headers, the assistant header ends the user turn; pad ``<SPECIAL_233>``."""

    preset_pad = "<SPECIAL_233>"

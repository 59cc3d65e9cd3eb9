"""``passthrough``: every content verbatim (NeMo RL's ``chat_template: null``, for pre-rendered text)."""

from __future__ import annotations

from packsft.prompt_formats.base import PerTurnFormat, Segment
from packsft.prompt_formats.spans import check_masks, trained_turns


class Passthrough(PerTurnFormat):
    """Contents concatenated; the trained assistant contents are trained, everything else masked.

    The format writes nothing after a turn: ``append_eos`` defaults to on (when the tokenizer has an EOS).
    """

    def ends_silently(self, tokenizer) -> bool:
        """Always: a content is followed by the next one."""
        return True

    def render(self, messages, tools, tokenizer, chat_template_kwargs):
        """Prompt text (the contents since the last trained turn), trained content, ..., prompt text."""
        check_masks(messages)
        turns = set(trained_turns(messages, self.train_on))
        segments: list[Segment] = []
        prompt, first = "", 0
        for i, m in enumerate(messages):
            if i in turns:
                segments.append(Segment(prompt, first, False))
                segments.append(Segment(m.get("content") or "", i, True))
                prompt, first = "", i + 1
            else:
                prompt += m.get("content") or ""
        segments.append(Segment(prompt, first, False))
        return segments

"""What a prompt format is: :class:`PromptFormat`, the base class every registered format derives from.

A format is a frozen dataclass bound to one tokenizer (its pad token, template and options); its class decides
how a conversation becomes :class:`Segment` texts (:meth:`PromptFormat.segments`), which texts are encoded
(:meth:`PromptFormat.texts`) and how their ids become the conversation's pieces (:meth:`PromptFormat.assemble`).
Two families: the Megatron-LM presets (``megatron.py``) encode the whole rendering at once; the per-turn formats
(:class:`PerTurnFormat`: ``chat-template``, ``passthrough``) encode every segment on its own.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # transformers is imported by the tokenizer loader, when a tokenizer is needed
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase


class PromptFormatError(ValueError):
    """A conversation that the prompt format cannot render or mask.

    Attributes:
        turn: index of the offending message in the conversation, or ``None`` for the whole conversation.
        reason: what is wrong.
    """

    def __init__(self, reason: str, turn: int | None = None):
        self.turn, self.reason = turn, reason
        super().__init__(f"messages[{turn}]: {reason}" if turn is not None else reason)


class NonMegatronError(PromptFormatError):
    """A conversation a Megatron preset can tokenize but Megatron-LM's ``SFTTokenizer`` refuses.

    Raised only when ``PromptFormat.allow_non_megatron`` is false; with it the conversation is tokenized
    anyway (turns that merge across a boundary are then encoded each on its own).
    """


class Segment(NamedTuple):
    """A piece of a rendered conversation (a named tuple: one is made per turn of every conversation).

    Attributes:
        text: the rendered text.
        turn: index of the message it renders (``-1`` for template text outside any message).
        trained: whether its tokens are targets.
        masked_prefix: number of leading tokens that stay masked even when ``trained``.
    """

    text: str
    turn: int
    trained: bool
    masked_prefix: int = 0


def short_sha256(text: str | None) -> str:
    """SHA-256 of ``text`` (UTF-8), hex, first 16 characters; ``""`` for no text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16] if text else ""


@dataclass(frozen=True)
class PromptFormat:
    """A prompt format bound to one tokenizer; made by :func:`~packsft.prompt_formats.get_prompt_format`.

    This class holds what every format shares (name, pad, options, :meth:`spec`); the registered subclass of the
    name renders (one built here directly describes a format, e.g. to compare sidecars, and renders nothing).

    Attributes:
        name: its name in the registry (:data:`~packsft.prompt_formats.PRESETS`).
        pad_token: pad token string; its id fills CP and tail padding and is never trained.
        pad_token_id: id of ``pad_token``.
        chat_template: the Jinja template (``chat-template`` only).
        train_on: ``all`` assistant turns, or only the ``last`` of each conversation (``chat-template``,
            ``passthrough``).
        chat_template_kwargs: keyword arguments of ``apply_chat_template`` (``{"enable_thinking": False}``).
        append_eos: the tokenizer's EOS id is appended to every trained assistant turn (the template writes
            no end of turn after it).
        template_name: a name for messages (the tokenizer's path and the template hash); not compared.
        allow_non_megatron: Megatron presets: tokenize a conversation Megatron-LM refuses instead of raising
            :class:`NonMegatronError`; not compared, not in the sidecar (a conversation Megatron-LM accepts is
            tokenized identically either way).
    """

    name: str
    pad_token: str
    pad_token_id: int
    chat_template: str | None = None
    train_on: str = "all"
    chat_template_kwargs: dict[str, Any] | None = None
    append_eos: bool = False
    template_name: str = field(default="", compare=False)
    allow_non_megatron: bool = field(default=False, compare=False)

    preset_pad: ClassVar[str | None] = None
    """The format's own pad token; ``None``: the tokenizer's (see ``get_prompt_format``)."""
    megatron: ClassVar[bool] = False
    """Megatron-LM's ``SFTTokenizer`` has this format (the packed file is Megatron-LM compatible)."""
    per_turn: ClassVar[bool] = False
    """Each segment is encoded on its own; ``train_on``, ``append_eos`` and ``weight: 0`` apply."""
    templated: ClassVar[bool] = False
    """Renders a Jinja chat template: ``chat_template`` and ``chat_template_kwargs`` apply."""
    whole_texts: ClassVar[int] = 0
    """Number of texts :meth:`texts` puts before the segments' own (the whole rendering's)."""

    @property
    def template_sha256(self) -> str | None:
        """SHA-256 (hex, 16 chars) of the chat template, or ``None`` for the presets."""
        return None if self.chat_template is None else short_sha256(self.chat_template)

    @property
    def noun(self) -> str:
        """The format in messages (``prompt format passthrough``)."""
        return f"prompt format {self.name}"

    def spec(self) -> dict[str, Any]:
        """JSON-able description recorded in the packed file's sidecar."""
        return {"name": self.name, "pad_token": self.pad_token, "pad_token_id": self.pad_token_id,
                "chat_template_sha256": self.template_sha256, "train_on": self.train_on,
                "chat_template_kwargs": dict(self.chat_template_kwargs or {}), "append_eos": self.append_eos}

    @classmethod
    def template_for(cls, tokenizer: PreTrainedTokenizerBase, chat_template: str | Path | None) -> str | None:
        """The chat template the format renders with (read and checked once), or ``None``."""
        return None

    def renders(self, what: str) -> bool:
        """Whether the format renders a conversation's ``tools`` or its assistant turns' ``tool_calls``."""
        return False

    def missing_stop_signal(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        """True when trained assistant turns end without any stop signal (no end-of-turn text, no EOS)."""
        return False

    def segments(self, messages: list[dict[str, Any]], tools: list | None, tokenizer: PreTrainedTokenizerBase,
                 chat_template_kwargs: dict[str, Any] | None = None) -> list[Segment]:
        """The conversation rendered to segments (see :func:`~packsft.prompt_formats.render_segments`)."""
        raise NotImplementedError(f"{type(self).__name__} does not render; get_prompt_format({self.name!r}, ...) does")

    def texts(self, segments: list[Segment]) -> tuple[list[Segment], list[str]]:
        """The segments :meth:`assemble` takes and the texts to encode for them (:attr:`whole_texts` first); called
        only after :meth:`segments`, so every rendering subclass defines it."""

    def assemble(self, segments: list[Segment], encoded: list[list[int]], tokenizer: PreTrainedTokenizerBase
                 ) -> list[tuple[Segment, list[int]]]:
        """Each segment with its token ids, from :meth:`texts` and the ids of its texts.

        Raises:
            PromptFormatError: the ids do not make the conversation (see the format).
        """


class PerTurnFormat(PromptFormat, ABC):
    """A format whose segments are encoded each on its own: prompt parts, then each trained assistant turn.

    No token crosses a header and a reply; an assistant turn is trained unless it is empty, has ``weight: 0``
    or ``train_on="last"`` skips it; ``append_eos`` adds EOS to each trained turn.
    """

    per_turn = True

    @abstractmethod
    def ends_silently(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        """True when the format writes nothing after an assistant turn's content."""

    @abstractmethod
    def render(self, messages: list[dict[str, Any]], tools: list | None, tokenizer: PreTrainedTokenizerBase,
               chat_template_kwargs: dict[str, Any] | None) -> list[Segment]:
        """The segments of a conversation that :meth:`segments` accepted: prompt, trained, ..., prompt."""

    def segments(self, messages, tools, tokenizer, chat_template_kwargs=None) -> list[Segment]:
        """Refuse a tool-call turn without content when the format does not render tool calls, then render."""
        if not self.renders("tool_calls"):
            for i, m in enumerate(messages):   # such a turn would train only its end of turn, right after the prompt
                if m.get("tool_calls") and not (m.get("content") or "").strip():
                    raise PromptFormatError(f"empty assistant turn ({self.noun} does not render tool_calls; "
                                            "use a chat template that does)", i)
        return self.render(messages, tools, tokenizer, chat_template_kwargs)

    def texts(self, segments):
        """Every segment's own text."""
        return segments, [s.text for s in segments]

    def assemble(self, segments, encoded, tokenizer):
        """Each non-empty segment with its ids, EOS appended to trained turns when :attr:`append_eos`."""
        eos = tokenizer.eos_token
        out = []
        for seg, piece in zip(segments, encoded):
            if seg.trained and self.append_eos and not seg.text.rstrip().endswith(eos):
                piece = piece + [tokenizer.eos_token_id]
            if seg.text or piece:
                out.append((seg, piece))
        return out

    def missing_stop_signal(self, tokenizer):
        """True when the format writes no end of turn and EOS is not appended."""
        return self.ends_silently(tokenizer) and not self.append_eos


def unrendered(messages: list[dict[str, Any]], tools: list | None, fmt: PromptFormat) -> list[tuple[str, str]]:
    """Warnings ``(kind, message)`` for what a conversation holds that ``fmt`` never renders.

    ``tools_not_rendered``: it has tool schemas and the format does not render them (the presets and
    ``passthrough``; a chat template that never reads ``tools``, e.g. SmolLM2's). ``tool_calls_not_rendered``:
    an assistant turn with content also carries ``tool_calls``, which the format drops (a chat template whose
    text never names ``tool_calls``). The row keeps both; the model is trained without them.
    """
    out = []
    if tools and not fmt.renders("tools"):
        out.append(("tools_not_rendered", f"tools: {len(tools)} tool schema(s) that {fmt.noun} does not "
                    "render: the model never sees them (the row keeps them); use a template that renders tools"))
    calls = sum(1 for m in messages if m.get("tool_calls"))
    if calls and not fmt.renders("tool_calls"):
        out.append(("tool_calls_not_rendered", f"tool_calls of {calls} assistant turn(s) that {fmt.noun} "
                    "does not render: only their content is trained (the row keeps the calls); use a template "
                    "that renders tool calls"))
    return out

"""Rendering with a chat template: ``apply_chat_template`` calls, their keyword arguments, the template's shape."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packsft.prompt_formats.base import PromptFormatError

if TYPE_CHECKING:
    from packsft.prompt_formats.base import PromptFormat

OPEN, CLOSE = "\ue000", "\ue001"
"""Private-use markers around assistant contents (the one-render path and the template's shape probe)."""

RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""``apply_chat_template`` arguments packsft sets itself: refused in ``chat_template_kwargs`` (they would change
what is rendered or returned, not what the template sees)."""

_SHAPES: dict[tuple, Any] = {}  # (template, eos, bos, kwargs) -> TemplateShape
_LAST_SHAPE: list[Any] = [None, None, None]  # (fmt, tokenizer, shape) of the last call with only fmt's kwargs


def check_reserved(kwargs: dict[str, Any] | None, what: str) -> None:
    """Raise :class:`PromptFormatError` when ``kwargs`` (named ``what``) sets a :data:`RESERVED_TEMPLATE_KWARGS`."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
    if reserved:
        raise PromptFormatError(f"{what} sets {', '.join(map(repr, reserved))}, which packsft sets itself when it "
                                "renders a conversation; pass only variables the chat template reads "
                                "(e.g. enable_thinking)")


def template_kwargs(fmt: PromptFormat, chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments of ``apply_chat_template``: the format's, overridden by the conversation's.

    Raises:
        PromptFormatError: the conversation's own set one of :data:`RESERVED_TEMPLATE_KWARGS`.
    """
    check_reserved(chat_template_kwargs, "the record's chat_template_kwargs")
    return {**(fmt.chat_template_kwargs or {}), **(chat_template_kwargs or {})}


def render_many(tokenizer, fmt: PromptFormat, conversations: list[list[dict]], tools,
                kwargs: dict[str, Any] | None = None, generation_prompt: bool = False) -> list[str]:
    """Render several conversations with the chat template in one ``apply_chat_template`` call.

    Raises:
        PromptFormatError: the template failed (its own error quoted).
    """
    try:  # tokenize=False on a batch: a list of str (the keyword arguments that change that are refused)
        texts = tokenizer.apply_chat_template(conversations, tools=tools, chat_template=fmt.chat_template,
                                              tokenize=False, add_generation_prompt=generation_prompt,
                                              **(kwargs or {}))
    except Exception as e:  # jinja2 errors and template `raise_exception` calls
        calls = any(m.get("tool_calls") or m.get("role") == "tool" for conv in conversations for m in conv)
        hint = " (the conversation has tool calls: this template may not support them)" if calls else ""
        raise PromptFormatError(f"chat template failed: {type(e).__name__}: {e}{hint}") from e
    return texts


@dataclass(frozen=True)
class TemplateShape:
    """What a chat template writes around an assistant turn, learned once from a probe conversation.

    Attributes:
        end_of_turn: text after an assistant content, trailing whitespace removed (``<|im_end|>``,
            ``</s>``; ``""`` when the template writes nothing after it); ``None`` when the probe fails.
        header: text ``add_generation_prompt=True`` appends to a conversation that ends with a user turn
            (``<|im_start|>assistant\\n``; ``""`` for Mistral's ``[INST]...[/INST]``); ``None`` when unknown.
    """

    end_of_turn: str | None
    header: str | None


def template_shape(tokenizer, fmt: PromptFormat, kwargs: dict[str, Any] | None = None) -> TemplateShape:
    """The :class:`TemplateShape` of ``fmt``'s chat template (cached per template, kwargs and specials)."""
    own = not kwargs  # only the format's own kwargs: remembered for the next call
    if own and _LAST_SHAPE[0] is fmt and _LAST_SHAPE[1] is tokenizer:
        return _LAST_SHAPE[2]
    kwargs = template_kwargs(fmt, kwargs)
    key = (fmt.chat_template, tokenizer.eos_token, tokenizer.bos_token,
           json.dumps(kwargs, sort_keys=True) if kwargs else "{}")
    if key not in _SHAPES:
        prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        probe = prompt + [{"role": "assistant", "content": f"{OPEN}a{CLOSE}"}]
        try:
            text, bare = render_many(tokenizer, fmt, [probe, prompt], None, kwargs)
            gen = render_many(tokenizer, fmt, [prompt], None, kwargs, generation_prompt=True)[0]
            eot = text[text.index(CLOSE) + 1 :].rstrip() if text.count(CLOSE) == 1 else None
            header = gen[len(bare):] if gen.startswith(bare) else None
        except PromptFormatError:
            eot = header = None
        _SHAPES[key] = TemplateShape(eot, header)
    if own:
        _LAST_SHAPE[:] = [fmt, tokenizer, _SHAPES[key]]
    return _SHAPES[key]

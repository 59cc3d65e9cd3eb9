"""``chat-template``: the tokenizer's Jinja chat template (or a custom one), tools and kwargs passed through.

The assistant turns are located in the rendered text in one of two ways, which give identical results (tested):

* fast path (one extra render, none when the template only concatenates the contents: :func:`_render_traced`):
  every trained assistant content is wrapped in private-use markers; removing the markers must give exactly the
  plain rendering, the template's end-of-turn text (learned once per template, e.g. ``<|im_end|>``) must follow
  each content, and its generation header must precede it (:func:`~packsft.prompt_formats.spans.marked_spans`);
* otherwise (tool-call turns, templates that transform contents): turn by turn, from renderings of each turn's
  own prefix (:func:`~packsft.prompt_formats.spans.turn_spans`).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

from packsft.prompt_formats.base import PerTurnFormat
from packsft.prompt_formats.spans import check_masks, header_checked, segments_from_spans, trained_turns
from packsft.prompt_formats.spans import marked_spans as _marked_spans
from packsft.prompt_formats.spans import turn_spans as _turn_spans
from packsft.prompt_formats.template import CLOSE, OPEN, render_many, template_kwargs, template_shape

try:  # the steps of apply_chat_template(tokenize=False), to render with traced contents in one call
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _compile_jinja_template,
        _normalize_chat_messages,
        _plain_template_data,
    )
except ImportError:  # another transformers: render twice, as apply_chat_template
    _compile_jinja_template = None


def _resolve_template(tokenizer, chat_template: str | Path | None) -> str:
    if chat_template is None:
        tmpl = getattr(tokenizer, "chat_template", None)
        if isinstance(tmpl, dict):
            tmpl = tmpl.get("default")
        if not tmpl:
            raise ValueError("prompt format 'chat-template': the tokenizer has no chat template; "
                             "pass one with --chat-template (a Jinja string or a file)")
        return tmpl
    text = str(chat_template)
    if "{%" in text or "{{" in text:
        return text
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--chat-template {text!r} is neither a Jinja template nor an existing file")
    return path.read_text(encoding="utf-8")


def _parsed_template(template: str):
    """The Jinja syntax tree of ``template`` as transformers compiles it (its extensions, ``{% break %}`` and
    ``{% generation %}``, included; the compiled template is cached by transformers, so rendering reuses it).

    Raises:
        jinja2.TemplateSyntaxError: ``template`` is not valid Jinja.
    """
    import jinja2

    env = (_compile_jinja_template(template).environment if _compile_jinja_template is not None
           else jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]))
    return env.parse(template)


def _check_syntax(template: str, what: str) -> None:
    """Raise ``ValueError`` (once, before any conversation) when ``template`` is not valid Jinja."""
    import jinja2

    try:
        _parsed_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{what} is not a valid Jinja template: {e.message} (template line {e.lineno})") from None


@functools.lru_cache(maxsize=16)
def _renders(template: str | None, what: str) -> bool:
    """Whether chat ``template`` can render ``what`` (``tools``: the template reads that variable;
    ``tool_calls``: its text names them)."""
    if not template:
        return False
    if what == "tool_calls":
        return "tool_calls" in template
    import jinja2
    from jinja2 import meta

    try:
        return what in meta.find_undeclared_variables(_parsed_template(template))
    except jinja2.TemplateError:
        return True  # not this check's to report: rendering it says what is wrong


def _template_messages(messages: list[dict[str, Any]], copy_plain: bool = True) -> list[dict[str, Any]]:
    """``messages`` with tool-call ``arguments`` parsed into dicts (templates expect objects): a deep copy when
    there are tool calls; otherwise a shallow copy, or ``messages`` itself unless ``copy_plain``."""
    if not any(m.get("tool_calls") for m in messages):
        return [dict(m) for m in messages] if copy_plain else messages  # nothing to parse
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return out


_TOUCHED = [False]  # set when a template does anything with a traced content but copy it into the output


def _touch(*_):
    _TOUCHED[0] = True
    return True


class _Traced(str):
    """A marked assistant content that records any use of it other than concatenation (``+``, ``join``).

    A template that only concatenates the content renders it verbatim, so the rendering with markers, markers
    removed, *is* the plain rendering; any other use (a method, ``len``, comparison, ``in``, ``str()``, ``%``,
    iteration, hashing, numeric conversion) sets :data:`_TOUCHED` and the conversation is rendered twice.
    """

    def __getattribute__(self, name):
        _touch()
        return str.__getattribute__(self, name)

    def __str__(self):
        _touch()
        return str.__str__(self)

    def __hash__(self):
        _touch()
        return str.__hash__(self)

    def __eq__(self, other):
        _touch()
        return str.__eq__(self, other)

    def __ne__(self, other):
        _touch()
        return str.__ne__(self, other)


def _traced_special(name):
    base = getattr(str, name, None)

    def method(self, *args):
        _touch()
        return base(self, *args) if base is not None else NotImplemented

    method.__name__ = name
    return method


for _name in ("__repr__", "__len__", "__iter__", "__getitem__", "__contains__", "__lt__", "__le__", "__gt__",
              "__ge__", "__format__", "__mod__", "__rmod__", "__mul__", "__rmul__", "__int__", "__float__",
              "__complex__", "__index__", "__bytes__", "__reduce__", "__reduce_ex__", "__sizeof__", "__getnewargs__"):
    setattr(_Traced, _name, _traced_special(_name))


def _template_data(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as ``apply_chat_template`` hands them to the template (``None`` values dropped, plain types).

    Messages whose values are all exact ``str`` or ``None`` (most conversations) are copied directly; others go
    through transformers' own conversion, so both give the same data.
    """
    if all(type(v) is str or v is None for m in msgs for v in m.values()):
        return [{k: v for k, v in m.items() if v is not None} for m in msgs]
    return _plain_template_data(_normalize_chat_messages(msgs))


def _render_traced(tokenizer, fmt: ChatTemplate, msgs, turns, tools, kwargs) -> str | None:
    """The rendering of ``msgs`` with each trained content wrapped in markers, or ``None``.

    Does what ``apply_chat_template(msgs, tools=tools, chat_template=..., tokenize=False, **kwargs)`` does, with
    the trained contents as :class:`_Traced` strings. ``None`` (render twice instead) when the template used a
    traced content other than by concatenation, or failed.
    """
    if _compile_jinja_template is None or not all(isinstance(t, dict) for t in tools or ()):
        return None
    try:
        compiled = _compile_jinja_template(tokenizer.get_chat_template(fmt.chat_template, tools))
        chat = _alias_reasoning_fields(_template_data(msgs))
        for i in turns:
            chat[i] = dict(chat[i])
            chat[i]["content"] = _Traced(f"{OPEN}{msgs[i]['content']}{CLOSE}")
        _TOUCHED[0] = False
        # special_tokens_map's values are plain str: only kwargs need converting
        text = compiled.render(messages=chat, tools=_plain_template_data(tools), documents=None,
                               add_generation_prompt=False,
                               **{**tokenizer.special_tokens_map, **(_plain_template_data(kwargs) if kwargs else {})})
    except Exception:  # the two-render path reports the template's error
        return None
    finally:
        touched, _TOUCHED[0] = _TOUCHED[0], False
    if touched or type(text) is not str:
        return None
    return text


class ChatTemplate(PerTurnFormat):
    """``chat-template`` (alias ``default``): everything but the trained assistant turns is masked.

    The prompt part of each trained turn (rendered up to and including the assistant header that
    ``add_generation_prompt=True`` appends) is encoded on its own, then the turn with its end-of-turn text.
    Pad: the tokenizer's pad, else its ``unk``.
    """

    templated = True

    @classmethod
    def template_for(cls, tokenizer, chat_template):
        """``chat_template`` (a Jinja string or a file), default the tokenizer's own, checked to be valid Jinja.

        Raises:
            ValueError: no template, a file that does not exist, or a Jinja syntax error.
        """
        template = _resolve_template(tokenizer, chat_template)
        _check_syntax(template, "--chat-template" if chat_template is not None else "the tokenizer's chat template")
        return template

    @property
    def noun(self) -> str:
        """``the chat template``."""
        return "the chat template"

    def renders(self, what):
        """``tools``: the template reads that variable; ``tool_calls``: its text names them."""
        return _renders(self.chat_template, what)

    def ends_silently(self, tokenizer) -> bool:
        """The template writes nothing after an assistant content (learned from a probe render)."""
        return template_shape(tokenizer, self).end_of_turn == ""

    def render(self, messages, tools, tokenizer, chat_template_kwargs):
        """Render once (or twice), locate the trained turns (see the module), cut the text at them."""
        check_masks(messages)
        shape = template_shape(tokenizer, self, chat_template_kwargs)
        kwargs = template_kwargs(self, chat_template_kwargs)
        msgs = _template_messages(messages, copy_plain=False)  # only read below (renderings copy what they change)
        turns = trained_turns(messages, self.train_on)
        plain = all(isinstance(msgs[i].get("content"), str) and not msgs[i].get("tool_calls") for i in turns)
        clean = not any(OPEN in str(m.get("content")) or CLOSE in str(m.get("content")) for m in msgs)
        spans = None
        fast = turns and shape.end_of_turn is not None and plain and clean
        if fast:
            marked_text = _render_traced(tokenizer, self, msgs, turns, tools, kwargs)
            if marked_text is not None:  # the template only copied the trained contents: one render is enough
                full = marked_text.replace(OPEN, "").replace(CLOSE, "")
                spans = header_checked(_marked_spans(turns, full, marked_text, shape.end_of_turn, derived=True),
                                       full, shape)
            fast = spans is not None
        if not fast and turns and shape.end_of_turn is not None and plain and clean:
            marked = [dict(m, content=f"{OPEN}{m['content']}{CLOSE}") if i in turns else m
                      for i, m in enumerate(msgs)]
            full, marked_text = render_many(tokenizer, self, [msgs, marked], tools, kwargs)
            spans = header_checked(_marked_spans(turns, full, marked_text, shape.end_of_turn), full, shape)
        elif not fast:
            full = render_many(tokenizer, self, [msgs], tools, kwargs)[0]
        if spans is None and turns:
            spans = _turn_spans(msgs, tools, tokenizer, self, kwargs, turns, full, shape)
        return segments_from_spans(full, turns, spans or [], len(messages) - 1)

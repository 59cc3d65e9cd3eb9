"""Prompt formats: one conversation -> ``(tokens, targets)``, the single token counter of packsft.

The packer and the loader both tokenize with :func:`tokenize_conversations` (:func:`tokenize_conversation` of
each conversation, a batch at a time), so a packed row is exactly as long as the packer said (rendered
examples and masking rules: ``docs/prompt_formats.md``).

Presets (from Megatron-LM's ``SFTTokenizer``, as used by NeMo RL's ``megatron_sft_packed``; none adds BOS
or EOS; ``targets`` equal ``tokens`` except where masked to ``IGNORE_INDEX``):

==================== ============================================ ==========================================
preset               rendering                                    masked
==================== ============================================ ==========================================
identity             every content verbatim                       system, user, tool turns (pad ``<unk>``)
nemotron-nano-v2     ``<SPECIAL_10>System\\n{s}\\n``,               system, user, tool turns and the first 3
                     ``<SPECIAL_11>User\\n{u}\\n``,                 tokens of each assistant turn (pad ``<unk>``)
                     ``<SPECIAL_11>Assistant\\n{a}\\n<SPECIAL_12>\\n``
nemotron-h-aligned   ``<SPECIAL_10>System\\n{s}\\n``,               system, user, tool turns (pad
                     ``<SPECIAL_11>User\\n{u}\\n<SPECIAL_11>Assistant\\n``, ``<SPECIAL_233>``)
                     ``{a}\\n``
chat-template        the tokenizer's Jinja chat template (or a    everything but the trained assistant turns
(alias ``default``)  custom one), tools and kwargs passed through (pad: tokenizer pad, else ``unk``)
passthrough          every content verbatim (NeMo RL's            everything but the trained assistant
                     ``chat_template: null``)                     contents (pad: as chat-template)
==================== ============================================ ==========================================

``{s}``/``{u}``/``{a}`` are the stripped contents; ``nemotron-nano-v2`` also deletes ``/think`` and
``/no_think`` from system and user text. In the Nemotron presets a ``tool`` turn renders to nothing and an
assistant turn that only carries ``tool_calls`` is an error (they do not render tool calls). The presets
tokenize the whole rendering, as Megatron-LM does, and refuse (:class:`NonMegatronError`) what Megatron-LM's
``SFTTokenizer`` refuses: a turn whose own tokens are not its slice of the whole, an assistant turn that does
not follow a user or tool turn. With ``allow_non_megatron`` such a conversation is kept instead (each turn
then encoded on its own: packsft-only).

``chat-template`` and ``passthrough`` build the ids as the model sees them when it generates: the prompt
part of each trained turn (rendered up to and including the assistant header that
``add_generation_prompt=True`` appends) is encoded on its own, then the assistant turn with its end-of-turn
text on its own, and so on; the pieces are concatenated. No token can straddle a header and a reply. An
assistant turn is trained unless it is empty, has ``"weight": 0``, or ``train_on="last"`` and it is not the
last assistant turn. When the template writes nothing after an assistant turn (``passthrough`` included),
``append_eos`` adds the tokenizer's EOS to each trained turn.

For ``chat-template`` the assistant turns are located in the rendered text in one of two ways, which give
identical results (tested):

* fast path (one extra render): every trained assistant content is wrapped in private-use markers; removing
  the markers must give exactly the plain rendering, the template's end-of-turn text (learned once per
  template, e.g. ``<|im_end|>``) must follow each content, and its generation header must precede it;
* otherwise (tool-call turns, templates that transform contents): turn ``i`` starts after
  ``render(messages[:i], add_generation_prompt=True)`` (after an empty generation prompt: after the role marker
  the message renders itself, masked as on the fast path) and ends where ``render(messages[:i+1])`` ends,
  trailing whitespace removed; templates that place the system prompt or the tools before the last user
  turn, as Mistral's, are handled by finding that text in the whole rendering.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from packsft.layout import IGNORE_INDEX
from packsft.tokenizer import token_id

if TYPE_CHECKING:  # transformers is imported by the tokenizer loader, when a tokenizer is needed
    from transformers import PreTrainedTokenizerBase

PRESETS = ("identity", "nemotron-nano-v2", "nemotron-h-aligned", "chat-template", "passthrough")
ALIASES = {"default": "chat-template"}
TRAIN_ON = ("all", "last")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use markers around assistant contents (fast path)
_SHAPES: dict[tuple, Any] = {}  # (template, eos, bos, kwargs) -> TemplateShape
_PRESET_PAD = {"identity": "<unk>", "nemotron-nano-v2": "<unk>", "nemotron-h-aligned": "<SPECIAL_233>"}
_MASKABLE = ("chat-template", "passthrough")
MEGATRON_PRESETS = ("identity", "nemotron-nano-v2", "nemotron-h-aligned")
_MEGATRON_HINT = ("Megatron-LM's SFTTokenizer refuses this conversation ({}), so it would crash Megatron-LM --sft "
                  "and NeMo RL megatron_sft_packed; --allow-non-megatron keeps it (the file is then packsft-only)")


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


@dataclass(frozen=True)
class PromptFormat:
    """A prompt format bound to one tokenizer.

    Attributes:
        name: one of :data:`PRESETS`.
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

    @property
    def template_sha256(self) -> str | None:
        """SHA-256 (hex, 16 chars) of the chat template, or ``None`` for the presets."""
        if self.chat_template is None:
            return None
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()[:16]

    def spec(self) -> dict[str, Any]:
        """JSON-able description recorded in the packed file's sidecar."""
        return {"name": self.name, "pad_token": self.pad_token, "pad_token_id": self.pad_token_id,
                "chat_template_sha256": self.template_sha256, "train_on": self.train_on,
                "chat_template_kwargs": dict(self.chat_template_kwargs or {}), "append_eos": self.append_eos}

    def missing_stop_signal(self, tokenizer: PreTrainedTokenizerBase) -> bool:
        """True when trained assistant turns end without any stop signal (no end-of-turn text, no EOS)."""
        if self.name == "passthrough":
            return not self.append_eos
        if self.name != "chat-template":
            return False
        return template_shape(tokenizer, self).end_of_turn == "" and not self.append_eos


def _resolve_template(tokenizer: PreTrainedTokenizerBase, chat_template: str | Path | None) -> str:
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


def get_prompt_format(
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    pad_token: str | None = None,
    chat_template: str | Path | None = None,
    train_on: str = "all",
    chat_template_kwargs: dict[str, Any] | None = None,
    append_eos: bool | None = None,
    allow_non_megatron: bool = False,
) -> PromptFormat:
    """Bind a prompt format to a tokenizer and resolve its pad token.

    Args:
        name: one of :data:`PRESETS` (or ``default``).
        tokenizer: a fast Hugging Face tokenizer.
        pad_token: replaces the preset's pad token (Megatron-LM's ``override_pad_token``).
        chat_template: for ``chat-template``: a Jinja string or a file; default: the tokenizer's own.
        train_on: ``all`` or ``last`` (``chat-template`` and ``passthrough`` only).
        chat_template_kwargs: keyword arguments of ``apply_chat_template`` (``chat-template`` only).
        append_eos: append EOS to every trained assistant turn; ``None``: when the template writes nothing
            after an assistant turn's content (always for ``passthrough``) and the tokenizer has an EOS.
        allow_non_megatron: see :class:`PromptFormat` (the Megatron presets only; ignored by the others).

    Returns:
        The :class:`PromptFormat`.

    Raises:
        ValueError: unknown name; pad token not in the vocabulary; pad equal to EOS (the loss mask is 0
            wherever the label is the pad, so EOS would never be learned); no chat template available;
            ``train_on``, ``chat_template``, ``chat_template_kwargs`` or ``append_eos`` given to a format that
            ignores them.
    """
    canonical = ALIASES.get(name, name)
    if canonical not in PRESETS:
        raise ValueError(f"unknown prompt format {name!r} (choose one of {', '.join(PRESETS)}, or 'default')")
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
    if canonical not in _MASKABLE and (train_on != "all" or append_eos):
        raise ValueError(f"--train-on and --append-eos need prompt format chat-template or passthrough; "
                         f"{canonical} masks as Megatron-LM does")
    if chat_template_kwargs and canonical != "chat-template":
        raise ValueError(f"--chat-template-kwargs needs prompt format chat-template, not {canonical}")
    if chat_template is not None and canonical != "chat-template":
        raise ValueError(f"--chat-template needs prompt format chat-template; {canonical} does not render a template")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a JSON object, got {type(chat_template_kwargs).__name__}")
    _check_reserved(chat_template_kwargs, "--chat-template-kwargs")
    template = _resolve_template(tokenizer, chat_template) if canonical == "chat-template" else None
    if template is not None:
        _check_syntax(template, "--chat-template" if chat_template is not None else "the tokenizer's chat template")
    if pad_token is not None:
        pad = pad_token
    elif canonical in _PRESET_PAD:
        pad = _PRESET_PAD[canonical]
    else:
        pad = tokenizer.pad_token
        if pad is None or pad == tokenizer.eos_token:
            pad = tokenizer.unk_token
        if pad is None or pad == tokenizer.eos_token:
            raise ValueError(f"prompt format {canonical!r}: the tokenizer's pad token is missing or equals EOS "
                             "and it has no other unk token; choose one with --pad-token")
    try:
        pad_id = token_id(tokenizer, pad)
    except ValueError as e:
        where = "--pad-token" if pad_token is not None else f"the {canonical} prompt format's pad token"
        raise ValueError(f"{where}: {e}; choose one this tokenizer has with --pad-token (or the data config's "
                         "pad_token)") from e
    if tokenizer.eos_token_id is not None and pad_id == tokenizer.eos_token_id:
        raise ValueError(f"pad token {pad!r} (id {pad_id}) equals the EOS token: padding is never trained, so "
                         "EOS would never be learned; choose another --pad-token")
    label = f"{getattr(tokenizer, 'name_or_path', '') or 'tokenizer'}"
    fmt = PromptFormat(name=canonical, pad_token=pad, pad_token_id=pad_id, chat_template=template,
                       train_on=train_on, chat_template_kwargs=dict(chat_template_kwargs or {}) or None,
                       allow_non_megatron=bool(allow_non_megatron),
                       template_name=f"{label} chat template {_sha(template)}" if template else label)
    if canonical in _MASKABLE:
        if append_eos is None:
            append_eos = tokenizer.eos_token_id is not None and (
                canonical == "passthrough" or template_shape(tokenizer, fmt).end_of_turn == "")
        if append_eos and tokenizer.eos_token_id is None:
            raise ValueError("--append-eos: the tokenizer has no EOS token")
        fmt = dataclasses.replace(fmt, append_eos=bool(append_eos))
    return fmt


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


def _sha(text: str | None) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16] if text else ""


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


def _strip_think(text: str) -> str:
    return text.replace("/think", "").replace("/no_think", "")


def _nemotron_segments(messages: list[dict[str, Any]], name: str) -> list[Segment]:
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
            if not content.strip():
                why = " (the Nemotron presets do not render tool_calls; use chat-template)" if m.get(
                    "tool_calls") else ""
                raise PromptFormatError(f"empty assistant turn{why}", i)
            if nano:
                segments.append(Segment(f"<SPECIAL_11>Assistant\n{content.strip()}\n<SPECIAL_12>\n", i, True, 3))
            else:
                segments.append(Segment(f"{content.strip()}\n", i, True))
        # tool turns render to nothing in the Nemotron presets
    return segments


def _identity_segments(messages: list[dict[str, Any]]) -> list[Segment]:
    """Megatron-LM's ``identity``: every content verbatim; system, user and tool turns masked."""
    segments = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if m["role"] == "assistant":
            if not isinstance(content, str) or not content.strip():
                why = " (identity does not render tool_calls; use chat-template)" if m.get("tool_calls") else ""
                raise PromptFormatError(f"empty assistant turn{why}", i)
            segments.append(Segment(content, i, True))
        else:
            segments.append(Segment(content or "", i, False))
    return segments


def _check_megatron_order(messages: list[dict[str, Any]]) -> None:
    """Raise :class:`NonMegatronError` for an assistant turn not right after a user or tool turn.

    Megatron-LM asserts ``conversation[i - 1]["role"] in ("user", "tool")`` for every assistant turn ``i``.
    """
    for i, m in enumerate(messages):
        prev = messages[i - 1]["role"]
        if m["role"] == "assistant" and prev not in ("user", "tool"):
            raise NonMegatronError(f"assistant turn follows a {prev!r} turn, not a user or tool turn; "
                                   + _MEGATRON_HINT.format("AssertionError"), i)


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


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""``apply_chat_template`` arguments packsft sets itself: refused in ``chat_template_kwargs`` (they would change
what is rendered or returned, not what the template sees)."""


def _check_reserved(kwargs: dict[str, Any] | None, what: str) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
    if reserved:
        raise PromptFormatError(f"{what} sets {', '.join(map(repr, reserved))}, which packsft sets itself when it "
                                "renders a conversation; pass only variables the chat template reads "
                                "(e.g. enable_thinking)")


def _kwargs(fmt: PromptFormat, chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments of ``apply_chat_template``: the format's, overridden by the conversation's.

    Raises:
        PromptFormatError: the conversation's own set one of :data:`RESERVED_TEMPLATE_KWARGS`.
    """
    _check_reserved(chat_template_kwargs, "the record's chat_template_kwargs")
    return {**(fmt.chat_template_kwargs or {}), **(chat_template_kwargs or {})}


def _render_many(tokenizer, fmt: PromptFormat, conversations: list[list[dict]], tools,
                 kwargs: dict[str, Any] | None = None, generation_prompt: bool = False) -> list[str]:
    """Render several conversations with the chat template in one ``apply_chat_template`` call."""
    try:
        texts = tokenizer.apply_chat_template(conversations, tools=tools, chat_template=fmt.chat_template,
                                              tokenize=False, add_generation_prompt=generation_prompt,
                                              **(kwargs or {}))
    except Exception as e:  # jinja2 errors and template `raise_exception` calls
        calls = any(m.get("tool_calls") or m.get("role") == "tool" for conv in conversations for m in conv)
        hint = " (the conversation has tool calls: this template may not support them)" if calls else ""
        raise PromptFormatError(f"chat template failed: {type(e).__name__}: {e}{hint}") from e
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise PromptFormatError(f"chat template rendered {type(texts).__name__}, expected text")
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
    kwargs = _kwargs(fmt, kwargs)
    key = (fmt.chat_template, tokenizer.eos_token, tokenizer.bos_token,
           json.dumps(kwargs, sort_keys=True) if kwargs else "{}")
    if key not in _SHAPES:
        prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        probe = prompt + [{"role": "assistant", "content": f"{_OPEN}a{_CLOSE}"}]
        try:
            text, bare = _render_many(tokenizer, fmt, [probe, prompt], None, kwargs)
            gen = _render_many(tokenizer, fmt, [prompt], None, kwargs, generation_prompt=True)[0]
            eot = text[text.index(_CLOSE) + 1 :].rstrip() if text.count(_CLOSE) == 1 else None
            header = gen[len(bare):] if gen.startswith(bare) else None
        except PromptFormatError:
            eot = header = None
        _SHAPES[key] = TemplateShape(eot, header)
    if own:
        _LAST_SHAPE[:] = [fmt, tokenizer, _SHAPES[key]]
    return _SHAPES[key]


_LAST_SHAPE: list[Any] = [None, None, None]  # (fmt, tokenizer, shape) of the last call with only fmt's kwargs


def _marked_spans(turns, full: str, marked: str, eot: str, derived: bool = False) -> list[tuple[int, int]] | None:
    """Assistant spans ``[start, end)`` in ``full`` from a rendering whose assistant contents carry markers.

    Returns ``None`` (use the per-turn path) unless removing the markers gives exactly ``full`` (not checked
    when ``derived``: ``full`` was made so), every turn has exactly one pair of markers, and the end-of-turn
    text follows each content.
    """
    if marked.count(_OPEN) != len(turns) or (not derived and marked.replace(_OPEN, "").replace(_CLOSE, "") != full):
        return None
    spans, removed, pos = [], 0, 0
    for _ in turns:
        o = marked.index(_OPEN, pos)
        c = marked.index(_CLOSE, o)
        if _OPEN in marked[o + 1 : c]:
            return None
        start, content_end = o - removed, c - removed - 1
        removed += 2
        pos = c + 1
        if not full.startswith(eot, content_end):
            return None
        spans.append((start, content_end + len(eot)))
    return spans


def _sentinel(message: dict[str, Any]) -> str:
    """A private-use character that ``message``'s content does not hold: the probe turn of :func:`_turn_spans`
    (one the content starts with would extend the common prefix into the content)."""
    text = str(message.get("content"))
    return next((chr(c) for c in range(0xE000, 0xE040) if chr(c) not in text), _OPEN)


def _turn_spans(msgs, tools, tokenizer, fmt: PromptFormat, kwargs, turns, full: str,
                shape: TemplateShape) -> list[tuple[int, int]]:
    """Assistant spans ``[start, end)`` in ``full``, each located from renderings of its own prefix.

    Turn ``i`` ends where ``render(messages[:i + 1])`` ends (trailing whitespace removed) and starts where
    ``render(messages[:i], add_generation_prompt=True)`` ends; when the template renders the prompt
    differently once the turn follows (Mistral's moves the system prompt to the last user turn), it starts
    where that rendering first differs from one whose turn ``i`` is a sentinel character. It starts there too
    when that point lies further on and right after the generation header (the message renders its own role
    marker after an empty generation prompt: the marker is masked, as :func:`_marked_spans` masks it). When the
    rendering is a prefix of ``full`` the span is taken as is; otherwise (templates that place tools before the
    *last* user turn) the trained text is searched in ``full`` after the previous span and must follow the same
    prompt ending.

    Raises:
        PromptFormatError: a turn that does not start after the template's generation header, or whose
            trained text cannot be found in the whole rendering.
    """
    n = len(turns)
    probes = [msgs[:i] + [{"role": "assistant", "content": _sentinel(msgs[i])}] for i in turns]
    texts = _render_many(tokenizer, fmt, [msgs[: i + 1] for i in turns] + probes, tools, kwargs)
    gens = _render_many(tokenizer, fmt, [msgs[:i] for i in turns], tools, kwargs, generation_prompt=True)
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


def _check_masks(messages, fmt: PromptFormat) -> None:
    """Raise when every assistant turn is empty, or when a preset meets ``weight: 0``."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if assistants and all(not (messages[i].get("content") or "").strip() and not messages[i].get("tool_calls")
                          for i in assistants):
        raise PromptFormatError("empty assistant turn (no assistant turn has content, nothing to train)",
                                assistants[0])


def _header_checked(spans, full: str, shape: TemplateShape):
    """``spans``, or ``None`` when a turn is not rendered right after the generation prompt (located turn by turn)."""
    if spans is not None and shape.header and not all(full.endswith(shape.header, 0, s) for s, _ in spans):
        return None
    return spans


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

try:  # the steps of apply_chat_template(tokenize=False), to render with traced contents in one call
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _compile_jinja_template,
        _normalize_chat_messages,
        _plain_template_data,
    )
except ImportError:  # another transformers: render twice, as apply_chat_template
    _compile_jinja_template = None


def _template_data(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as ``apply_chat_template`` hands them to the template (``None`` values dropped, plain types).

    Messages whose values are all exact ``str`` or ``None`` (most conversations) are copied directly; others go
    through transformers' own conversion, so both give the same data.
    """
    if all(type(v) is str or v is None for m in msgs for v in m.values()):
        return [{k: v for k, v in m.items() if v is not None} for m in msgs]
    return _plain_template_data(_normalize_chat_messages(msgs))


def _render_traced(tokenizer, fmt: PromptFormat, msgs, turns, tools, kwargs) -> str | None:
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
            chat[i]["content"] = _Traced(f"{_OPEN}{msgs[i]['content']}{_CLOSE}")
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


def _segments_from_spans(full: str, turns, spans, last: int) -> list[Segment]:
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


def _chat_template_segments(messages, tools, tokenizer, fmt: PromptFormat, kwargs=None) -> list[Segment]:
    _check_masks(messages, fmt)
    shape = template_shape(tokenizer, fmt, kwargs)
    kwargs = _kwargs(fmt, kwargs)
    msgs = _template_messages(messages, copy_plain=False)  # only read below (renderings copy what they change)
    turns = trained_turns(messages, fmt.train_on)
    plain = all(isinstance(msgs[i].get("content"), str) and not msgs[i].get("tool_calls") for i in turns)
    clean = not any(_OPEN in str(m.get("content")) or _CLOSE in str(m.get("content")) for m in msgs)
    spans = None
    fast = turns and shape.end_of_turn is not None and plain and clean
    if fast:
        marked_text = _render_traced(tokenizer, fmt, msgs, turns, tools, kwargs)
        if marked_text is not None:  # the template only copied the trained contents: one render is enough
            full = marked_text.replace(_OPEN, "").replace(_CLOSE, "")
            spans = _header_checked(_marked_spans(turns, full, marked_text, shape.end_of_turn, derived=True), full,
                                    shape)
        fast = spans is not None
    if not fast and turns and shape.end_of_turn is not None and plain and clean:
        marked = [dict(m, content=f"{_OPEN}{m['content']}{_CLOSE}") if i in turns else m
                  for i, m in enumerate(msgs)]
        full, marked_text = _render_many(tokenizer, fmt, [msgs, marked], tools, kwargs)
        spans = _header_checked(_marked_spans(turns, full, marked_text, shape.end_of_turn), full, shape)
    elif not fast:
        full = _render_many(tokenizer, fmt, [msgs], tools, kwargs)[0]
    if spans is None and turns:
        spans = _turn_spans(msgs, tools, tokenizer, fmt, kwargs, turns, full, shape)
    return _segments_from_spans(full, turns, spans or [], len(messages) - 1)


def _passthrough_segments(messages, fmt: PromptFormat) -> list[Segment]:
    turns = set(trained_turns(messages, fmt.train_on))
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


def unrendered(messages: list[dict[str, Any]], tools: list | None, fmt: PromptFormat) -> list[tuple[str, str]]:
    """Warnings ``(kind, message)`` for what a conversation holds that ``fmt`` never renders.

    ``tools_not_rendered``: it has tool schemas and the format does not render them (the presets and
    ``passthrough``; a chat template that never reads ``tools``, e.g. SmolLM2's). ``tool_calls_not_rendered``:
    an assistant turn with content also carries ``tool_calls``, which the format drops (a chat template whose
    text never names ``tool_calls``). The row keeps both; the model is trained without them.
    """
    out = []
    if tools and not _renders(fmt.name, fmt.chat_template, "tools"):
        out.append(("tools_not_rendered", f"tools: {len(tools)} tool schema(s) that {_format_words(fmt)} does not "
                    "render: the model never sees them (the row keeps them); use a template that renders tools"))
    calls = sum(1 for m in messages if m.get("tool_calls"))
    if calls and not _renders(fmt.name, fmt.chat_template, "tool_calls"):
        out.append(("tool_calls_not_rendered", f"tool_calls of {calls} assistant turn(s) that {_format_words(fmt)} "
                    "does not render: only their content is trained (the row keeps the calls); use a template "
                    "that renders tool calls"))
    return out


def _format_words(fmt: PromptFormat) -> str:
    return "the chat template" if fmt.name == "chat-template" else f"prompt format {fmt.name}"


@functools.lru_cache(maxsize=16)
def _renders(name: str, template: str | None, what: str) -> bool:
    """Whether prompt format ``name`` with chat ``template`` can render ``what`` (``tools``: the template reads
    that variable; ``tool_calls``: its text names them)."""
    if name != "chat-template" or not template:
        return False
    if what == "tool_calls":
        return "tool_calls" in template
    import jinja2
    from jinja2 import meta

    try:
        return what in meta.find_undeclared_variables(_parsed_template(template))
    except jinja2.TemplateError:
        return True  # not this check's to report: rendering it says what is wrong


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
        NonMegatronError: (presets, unless ``fmt.allow_non_megatron``) an assistant turn that does not follow
            a user or tool turn.
    """
    if fmt.name in _MASKABLE and not _renders(fmt.name, fmt.chat_template, "tool_calls"):
        for i, m in enumerate(messages):   # such a turn would train only its end of turn, right after the prompt
            if m.get("tool_calls") and not (m.get("content") or "").strip():
                raise PromptFormatError(f"empty assistant turn ({_format_words(fmt)} does not render tool_calls; "
                                        "use a chat template that does)", i)
    if fmt.name == "chat-template":
        return _chat_template_segments(messages, tools, tokenizer, fmt, chat_template_kwargs)
    if fmt.name == "passthrough":
        _check_masks(messages, fmt)
        return _passthrough_segments(messages, fmt)
    for i, m in enumerate(messages):
        if m.get("weight", 1) == 0:
            raise PromptFormatError(f"'weight: 0' needs prompt format chat-template or passthrough; {fmt.name} "
                                    "masks as Megatron-LM does", i)
    segments = _identity_segments(messages) if fmt.name == "identity" else _nemotron_segments(messages, fmt.name)
    if not fmt.allow_non_megatron:
        _check_megatron_order(messages)
    return segments


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


def tokenize_segments(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    known: dict[str, list[int]] | None = None,
) -> list[tuple[Segment, list[int]]]:
    """Each rendered segment with its token ids, in order (their concatenation is the conversation).

    ``chat-template`` and ``passthrough`` encode every segment on its own (prompt parts through the
    assistant header, then each trained assistant turn, plus EOS when ``fmt.append_eos``): no token crosses
    a header and a reply. The presets encode the whole rendering and check that every segment's own tokens
    equal its slice (Megatron-LM tokenizes the whole string and asserts this); with
    ``fmt.allow_non_megatron`` a conversation that fails the check gets each segment's own tokens instead.

    Segments with equal texts get the same list of ids (each distinct text is encoded once), as do those
    taken from ``known``: do not change the pieces in place.

    Args:
        known: text -> ids of segment texts already encoded (each is encoded alone), taken from it and extended
            with the new ones, so that tokenizing variants of one conversation (the packer's own-row cuts)
            encodes each segment text once (the presets also encode their whole text each time).

    Raises:
        PromptFormatError: as :func:`render_segments`.
        NonMegatronError: (presets, unless ``fmt.allow_non_megatron``) a token that crosses a turn boundary
            (names the message and the text on both sides), or an assistant turn not after a user/tool turn.
    """
    got = _segments_batch([(messages, tools, chat_template_kwargs)], tokenizer, fmt, [known])[0]
    if isinstance(got, PromptFormatError):
        raise got
    return got


def _segments_batch(conversations, tokenizer, fmt: PromptFormat, known: list | None = None) -> list:
    """:func:`tokenize_segments` of each ``(messages, tools, chat_template_kwargs)``, stage by stage over the
    batch (render all, one encode call for all their new texts, then each one's pieces); per conversation its
    result or the :class:`PromptFormatError` it raised. ``known``: per conversation ``None`` or its own dict
    (as in :func:`tokenize_segments`); the presets' whole text, which a cut always changes, is not kept."""
    if known is not None and len(known) != len(conversations):
        raise ValueError(f"known has {len(known)} entries for {len(conversations)} conversations")
    whole = 0 if fmt.name in ("chat-template", "passthrough") else 1  # texts before the segments' own
    out: list = []
    staged = []  # (index into out, segments, texts, dict, number of them encoded)
    todo: list[str] = []
    for (messages, tools, kwargs), memo in zip(conversations, known or [None] * len(conversations)):
        try:
            segments, own = _segment_texts(render_segments(messages, tools, tokenizer, fmt, kwargs), fmt)
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
            out[i] = _assemble(segments, ids, tokenizer, fmt)
        except PromptFormatError as e:
            out[i] = e
        pos += n
    return out


def _segment_texts(segments: list[Segment], fmt: PromptFormat) -> tuple[list[Segment], list[str]]:
    """The segments :func:`_assemble` takes and the texts to encode for them (presets: the whole text first)."""
    if fmt.name in ("chat-template", "passthrough"):
        return segments, [s.text for s in segments]
    segments = [s for s in segments if s.text]
    return segments, ["".join(s.text for s in segments)] + [s.text for s in segments]


def _assemble(segments: list[Segment], encoded: list[list[int]], tokenizer, fmt: PromptFormat
              ) -> list[tuple[Segment, list[int]]]:
    """:func:`tokenize_segments`' result from :func:`_segment_texts` and the ids of its texts."""
    if fmt.name in ("chat-template", "passthrough"):
        eos = tokenizer.eos_token
        out = []
        for seg, piece in zip(segments, encoded):
            if seg.trained and fmt.append_eos and not seg.text.rstrip().endswith(eos):
                piece = piece + [tokenizer.eos_token_id]
            if seg.text or piece:
                out.append((seg, piece))
        return out
    tokens, pieces = encoded[0], encoded[1:]
    pos = 0
    for k, piece in enumerate(pieces):
        if tokens[pos : pos + len(piece)] != piece:
            if fmt.allow_non_megatron:
                break  # packsft-only: every turn encoded on its own
            raise _boundary_error(tokenizer, segments, pieces, tokens, k, pos)
        pos += len(piece)
    else:
        if pos != len(tokens) and not fmt.allow_non_megatron:
            raise NonMegatronError(f"turns cover {pos} tokens but the conversation has {len(tokens)}; "
                                   + _MEGATRON_HINT.format("AssertionError: mismatch in target masking"))
    return list(zip(segments, pieces))


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
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    known: dict[str, list[int]] | None = None,
    runs: bool = False,
) -> tuple[list[int], list[int]]:
    """Tokenize one conversation and build its targets (Megatron-LM ``SFTTokenizer.tokenize_conversation``).

    Args:
        messages: the conversation (first message ``system``); assistant turns may carry ``"weight": 0|1``.
        tokenizer: fast Hugging Face tokenizer.
        fmt: prompt format bound to ``tokenizer`` (:func:`get_prompt_format`).
        tools: the conversation's tool schemas (``chat-template`` renders them).
        chat_template_kwargs: this conversation's ``apply_chat_template`` keyword arguments.
        known: as in :func:`tokenize_segments`.
        runs: give the targets as runs, ``(tokens, runs)`` (as :func:`tokenize_conversations`).

    Returns:
        ``(tokens, targets)``: two equally long lists of int token ids; ``targets[i]`` is ``tokens[i]`` where
        trained, else :data:`IGNORE_INDEX`. No BOS/EOS is added beyond what the format renders, except the
        EOS of ``fmt.append_eos``.

    Raises:
        PromptFormatError: the conversation cannot be rendered, renders to no token, or (presets) a token
            crosses a turn boundary (the error names the message and the text on both sides).
    """
    pairs = tokenize_segments(messages, tokenizer, fmt, tools, chat_template_kwargs, known)
    return _target_runs(pairs) if runs else _targets(pairs)


def tokenize_conversations(
    conversations: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any] | None]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    known: list[dict[str, list[int]] | None] | None = None,
    runs: bool = False,
) -> list[tuple[list[int], list[int]] | PromptFormatError]:
    """:func:`tokenize_conversation` of each ``(messages, tools, chat_template_kwargs)``, the same results.

    Each stage runs over the whole batch (render all, one encode call for all their texts, then the targets):
    the packer's hot loop, faster than one conversation at a time as each stage's code and data stay in cache
    (``bench/pack.py``).

    Args:
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
    for got in _segments_batch(conversations, tokenizer, fmt, known):
        try:
            out.append(got if isinstance(got, PromptFormatError) else finish(got))
        except PromptFormatError as e:  # renders to no tokens
            out.append(e)
    return out


def count_conversation_tokens(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> int:
    """Number of tokens of a conversation: ``len(tokenize_conversation(...)[0])``.

    The packer's token counter; it runs the loader's own tokenization (including the masking checks),
    so a conversation that would fail in the loader fails here, at packing time.

    Raises:
        PromptFormatError: as :func:`tokenize_conversation`.
    """
    return len(tokenize_conversation(messages, tokenizer, fmt, tools, chat_template_kwargs)[0])

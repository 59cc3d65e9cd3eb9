"""Prompt formats: one conversation -> ``(tokens, targets)``, the single token counter of packsft.

The packer counts tokens with :func:`count_conversation_tokens` and the loader builds rows with
:func:`tokenize_conversation`; both run the same code, so a packed row is exactly as long as the packer
said (rendered examples and masking rules: ``docs/prompt_formats.md``).

Presets (from Megatron-LM's ``SFTTokenizer``, as used by NeMo RL's ``megatron_sft_packed``; none adds BOS
or EOS; ``targets`` equal ``tokens`` except where masked to ``IGNORE_INDEX``):

==================== ============================================ ==========================================
preset               rendering                                    masked
==================== ============================================ ==========================================
identity             every content verbatim                       nothing (pad ``<unk>``)
nemotron-nano-v2     ``<SPECIAL_10>System\\n{s}\\n``,               system, user, tool turns and the first 3
                     ``<SPECIAL_11>User\\n{u}\\n``,                 tokens of each assistant turn (pad ``<unk>``)
                     ``<SPECIAL_11>Assistant\\n{a}\\n<SPECIAL_12>\\n``
nemotron-h-aligned   ``<SPECIAL_10>System\\n{s}\\n``,               system, user, tool turns (pad
                     ``<SPECIAL_11>User\\n{u}\\n<SPECIAL_11>Assistant\\n``, ``<SPECIAL_233>``)
                     ``{a}\\n``
chat-template        the tokenizer's Jinja chat template (or a    everything but the assistant turns (pad:
(alias ``default``)  custom one), tools passed through            tokenizer pad, else ``unk``)
==================== ============================================ ==========================================

``{s}``/``{u}``/``{a}`` are the stripped contents; ``nemotron-nano-v2`` also deletes ``/think`` and
``/no_think`` from system and user text. In the Nemotron presets a ``tool`` turn renders to nothing and an
assistant turn that only carries ``tool_calls`` is an error (they do not render tool calls).

Masking is verified: every turn is re-tokenized alone and must equal its slice of the whole conversation's
tokens; otherwise :class:`PromptFormatError` names the turn. For ``chat-template`` the assistant turns are
located in the rendered text in one of two ways, which give identical results (tested):

* fast path (one extra render): every assistant content is wrapped in private-use markers; removing the
  markers must give exactly the plain rendering, and the template's end-of-turn text (learned once per
  template from a probe conversation, e.g. ``<|im_end|>``) must follow each content;
* otherwise (tool-call turns, templates that transform contents): assistant turn ``i`` ends where rendering
  ``messages[:i+1]`` ends (that rendering must be a prefix of the whole one) and starts where it first
  differs from a rendering whose turn ``i`` is replaced by a sentinel, i.e. right after the template's
  assistant header. Templates that move the system prompt, as Mistral's does, are handled.

A turn is trained up to and including its end-of-turn token; trailing whitespace after it (Qwen's ``\n``
after ``<|im_end|>``) is not trained.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from packsft.layout import IGNORE_INDEX
from packsft.tokenizer import token_id

PRESETS = ("identity", "nemotron-nano-v2", "nemotron-h-aligned", "chat-template")
ALIASES = {"default": "chat-template"}
_SENTINEL = "\ue000"  # private-use character: never the first character of a real assistant turn
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use markers around assistant contents (fast path)
_END_OF_TURN: dict[tuple, str | None] = {}  # (template, eos, bos) -> text a template emits after assistant content
_PRESET_PAD = {"identity": "<unk>", "nemotron-nano-v2": "<unk>", "nemotron-h-aligned": "<SPECIAL_233>"}


class PromptFormatError(ValueError):
    """A conversation that the prompt format cannot render or mask.

    Attributes:
        turn: index of the offending message in the conversation, or ``None`` for the whole conversation.
        reason: what is wrong.
    """

    def __init__(self, reason: str, turn: int | None = None):
        self.turn, self.reason = turn, reason
        super().__init__(f"messages[{turn}]: {reason}" if turn is not None else reason)


@dataclass(frozen=True)
class PromptFormat:
    """A prompt format bound to one tokenizer.

    Attributes:
        name: one of :data:`PRESETS`.
        pad_token: pad token string; its id fills CP and tail padding and is never trained.
        pad_token_id: id of ``pad_token``.
        chat_template: the Jinja template (``chat-template`` only).
    """

    name: str
    pad_token: str
    pad_token_id: int
    chat_template: str | None = None

    @property
    def template_sha256(self) -> str | None:
        """SHA-256 (hex, 16 chars) of the chat template, or ``None`` for the presets."""
        if self.chat_template is None:
            return None
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()[:16]

    def spec(self) -> dict[str, Any]:
        """JSON-able description recorded in the packed file's sidecar."""
        return {"name": self.name, "pad_token": self.pad_token, "pad_token_id": self.pad_token_id,
                "chat_template_sha256": self.template_sha256}


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
) -> PromptFormat:
    """Bind a prompt format to a tokenizer and resolve its pad token.

    Args:
        name: ``identity``, ``nemotron-nano-v2``, ``nemotron-h-aligned``, ``chat-template`` (or ``default``).
        tokenizer: a fast Hugging Face tokenizer.
        pad_token: replaces the preset's pad token (Megatron-LM's ``override_pad_token``).
        chat_template: for ``chat-template``: a Jinja string or a file; default: the tokenizer's own.

    Returns:
        The :class:`PromptFormat`.

    Raises:
        ValueError: unknown name; pad token not in the vocabulary; pad equal to EOS (the loss mask is 0
            wherever the label is the pad, so EOS would never be learned); no chat template available.
    """
    canonical = ALIASES.get(name, name)
    if canonical not in PRESETS:
        raise ValueError(f"unknown prompt format {name!r} (choose one of {', '.join(PRESETS)}, or 'default')")
    template = _resolve_template(tokenizer, chat_template) if canonical == "chat-template" else None
    if pad_token is not None:
        pad = pad_token
    elif canonical in _PRESET_PAD:
        pad = _PRESET_PAD[canonical]
    else:
        pad = tokenizer.pad_token
        if pad is None or pad == tokenizer.eos_token:
            pad = tokenizer.unk_token
        if pad is None or pad == tokenizer.eos_token:
            raise ValueError("prompt format 'chat-template': the tokenizer's pad token is missing or equals EOS "
                             "and it has no other unk token; choose one with --pad-token")
    pad_id = token_id(tokenizer, pad)
    if tokenizer.eos_token_id is not None and pad_id == tokenizer.eos_token_id:
        raise ValueError(f"pad token {pad!r} (id {pad_id}) equals the EOS token: padding is never trained, so "
                         "EOS would never be learned; choose another --pad-token")
    return PromptFormat(name=canonical, pad_token=pad, pad_token_id=pad_id, chat_template=template)


@dataclass(frozen=True)
class Segment:
    """A piece of a rendered conversation.

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


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of ``messages`` with tool-call ``arguments`` parsed into dicts (templates expect objects)."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return out


def _render_many(tokenizer, fmt: PromptFormat, conversations: list[list[dict]], tools) -> list[str]:
    """Render several conversations with the chat template in one ``apply_chat_template`` call."""
    try:
        texts = tokenizer.apply_chat_template(conversations, tools=tools, chat_template=fmt.chat_template,
                                              tokenize=False, add_generation_prompt=False)
    except Exception as e:  # jinja2 errors and template `raise_exception` calls
        calls = any(m.get("tool_calls") or m.get("role") == "tool" for conv in conversations for m in conv)
        hint = " (the conversation has tool calls: this template may not support them)" if calls else ""
        raise PromptFormatError(f"chat template failed: {type(e).__name__}: {e}{hint}") from e
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise PromptFormatError(f"chat template rendered {type(texts).__name__}, expected text")
    return texts


def _end_of_turn(tokenizer, fmt: PromptFormat) -> str | None:
    """What the template writes after an assistant turn's content, trailing whitespace removed (cached).

    E.g. ``<|im_end|>`` for ChatML, ``</s>`` for Mistral; ``None`` when the probe conversation cannot be rendered.
    """
    key = (fmt.chat_template, tokenizer.eos_token, tokenizer.bos_token)
    if key not in _END_OF_TURN:
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": f"{_OPEN}a{_CLOSE}"}]
        try:
            text = _render_many(tokenizer, fmt, [probe], None)[0]
            _END_OF_TURN[key] = text[text.index(_CLOSE) + 1 :].rstrip() if text.count(_CLOSE) == 1 else None
        except PromptFormatError:
            _END_OF_TURN[key] = None
    return _END_OF_TURN[key]


def _marked_spans(msgs, turns, full: str, marked: str, eot: str) -> list[tuple[int, int]] | None:
    """Assistant spans ``[start, end)`` in ``full`` from a rendering whose assistant contents carry markers.

    Returns ``None`` (use the slow path) unless removing the markers gives exactly ``full``, every turn has
    exactly one pair of markers, and the end-of-turn text follows each content.
    """
    if marked.replace(_OPEN, "").replace(_CLOSE, "") != full or marked.count(_OPEN) != len(turns):
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


def _fast_spans(msgs, tools, tokenizer, fmt: PromptFormat, turns) -> tuple[str, list[tuple[int, int]] | None]:
    """Render the conversation and, when the template allows, locate all assistant turns in one more render."""
    eot = _end_of_turn(tokenizer, fmt)
    plain = all(isinstance(msgs[i].get("content"), str) and not msgs[i].get("tool_calls") for i in turns)
    clean = not any(_OPEN in str(m.get("content")) or _CLOSE in str(m.get("content")) for m in msgs)
    if eot is None or not (plain and clean):
        return _render_many(tokenizer, fmt, [msgs], tools)[0], None
    marked = [dict(m, content=f"{_OPEN}{m['content']}{_CLOSE}") if i in turns else m for i, m in enumerate(msgs)]
    full, marked_text = _render_many(tokenizer, fmt, [msgs, marked], tools)
    return full, _marked_spans(msgs, turns, full, marked_text, eot)


def _prefix_spans(msgs, tools, tokenizer, fmt: PromptFormat, turns, full: str) -> list[tuple[int, int]]:
    """Assistant spans by rendering each prefix that ends with an assistant turn and a sentinel probe of it."""
    prefixes = [msgs[: i + 1] for i in turns if i != len(msgs) - 1]
    probes = [msgs[:i] + [{"role": "assistant", "content": _SENTINEL}] for i in turns]
    texts = _render_many(tokenizer, fmt, prefixes + probes, tools)
    ends, starts = iter(texts[: len(prefixes)]), texts[len(prefixes) :]
    spans, done = [], 0
    for i, probe in zip(turns, starts):
        end_text = full if i == len(msgs) - 1 else next(ends)
        start = len(os.path.commonprefix([end_text, probe]))
        if not full.startswith(end_text) or start < done:
            raise PromptFormatError("chat template is not prefix-stable here: rendering the conversation up to "
                                    "this turn is not a prefix of the whole rendering, so the turn cannot be "
                                    "located for masking", i)
        done = len(end_text.rstrip())
        spans.append((start, done))
    return spans


def _chat_template_segments(messages, tools, tokenizer, fmt: PromptFormat) -> list[Segment]:
    msgs = _template_messages(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns:
        if not (messages[i].get("content") or "").strip() and not messages[i].get("tool_calls"):
            raise PromptFormatError("empty assistant turn", i)
    full, spans = _fast_spans(msgs, tools, tokenizer, fmt, turns)
    if spans is None:
        spans = _prefix_spans(msgs, tools, tokenizer, fmt, turns, full)
    segments: list[Segment] = []
    done = 0  # characters of `full` already assigned to segments
    for i, (start, end) in zip(turns, spans):
        if start > done:
            segments.append(Segment(full[done:start], i - 1, False))
        segments.append(Segment(full[start:end], i, True))
        done = end
    if done < len(full):
        segments.append(Segment(full[done:], len(messages) - 1, False))
    return segments


def render_segments(messages, tools, tokenizer: PreTrainedTokenizerBase, fmt: PromptFormat) -> list[Segment]:
    """Render a conversation into text segments with their training flags (no tokenization).

    Args:
        messages: the conversation's messages (first one ``system``).
        tools: its OpenAI function schemas or ``None`` (used by ``chat-template`` only).
        tokenizer, fmt: the tokenizer and the prompt format bound to it.

    Returns:
        Segments whose texts concatenate to the whole rendering.

    Raises:
        PromptFormatError: empty assistant turn, template failure, or a template that is not prefix-stable.
    """
    if fmt.name == "identity":
        return [Segment("".join(m.get("content") or "" for m in messages), -1, True)]
    if fmt.name == "chat-template":
        return _chat_template_segments(messages, tools, tokenizer, fmt)
    return _nemotron_segments(messages, fmt.name)


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def tokenize_conversation(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[int]]:
    """Tokenize one conversation and build its targets (Megatron-LM ``SFTTokenizer.tokenize_conversation``).

    Args:
        messages: the conversation (first message ``system``).
        tokenizer: fast Hugging Face tokenizer.
        fmt: prompt format bound to ``tokenizer`` (:func:`get_prompt_format`).
        tools: the conversation's tool schemas (``chat-template`` renders them).

    Returns:
        ``(tokens, targets)``: two equally long lists of int token ids; ``targets[i]`` is ``tokens[i]`` where
        trained, else :data:`IGNORE_INDEX`. No BOS/EOS is added beyond what the format renders.

    Raises:
        PromptFormatError: the conversation cannot be rendered, renders to no token, or a turn's own
            tokenization differs from its slice of the whole (the error names the turn and both token lists).
    """
    segments = [s for s in render_segments(messages, tools, tokenizer, fmt) if s.text]
    full_text = "".join(s.text for s in segments)
    if fmt.name == "identity":
        tokens = _encode(tokenizer, [full_text])[0]
        if not tokens:
            raise PromptFormatError("the conversation renders to no tokens")
        return tokens, list(tokens)
    encoded = _encode(tokenizer, [full_text] + [s.text for s in segments])
    tokens, pieces = encoded[0], encoded[1:]
    targets: list[int] = []
    pos = 0
    for seg, piece in zip(segments, pieces):
        if tokens[pos : pos + len(piece)] != piece:
            got = tokens[pos : pos + len(piece)]
            raise PromptFormatError(f"turn tokenized alone ({piece[:8]}...) differs from its slice of the "
                                    f"conversation ({got[:8]}...): a token crosses the turn boundary", seg.turn)
        if seg.trained:
            k = min(seg.masked_prefix, len(piece))
            targets += [IGNORE_INDEX] * k + piece[k:]
        else:
            targets += [IGNORE_INDEX] * len(piece)
        pos += len(piece)
    if pos != len(tokens):
        raise PromptFormatError(f"turns cover {pos} tokens but the conversation has {len(tokens)}")
    if not tokens:
        raise PromptFormatError("the conversation renders to no tokens")
    return tokens, targets


def count_conversation_tokens(
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    fmt: PromptFormat,
    tools: list[dict[str, Any]] | None = None,
) -> int:
    """Number of tokens of a conversation: ``len(tokenize_conversation(...)[0])``.

    The packer's only token counter; it runs the loader's own tokenization (including the masking checks),
    so a conversation that would fail in the loader fails here, at packing time.

    Raises:
        PromptFormatError: as :func:`tokenize_conversation`.
    """
    return len(tokenize_conversation(messages, tokenizer, fmt, tools)[0])

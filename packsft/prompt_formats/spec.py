"""The tokenization contract: :class:`TokenizationSpec`, the settings that decide a conversation's tokens and
targets, and :class:`Tokenization`, the same resolved (tokenizer loaded, prompt format bound).

A spec is built once where the settings enter (the packer's command line through ``PackConfig.tokenization``, the
training config's ``data`` section, a packed file's sidecar for the options the loader leaves open) and handed on
whole: the packer's workers and ``PackedSFTDataset`` take it resolved, so a process loads the tokenizer once and
binds the prompt format once. The sidecar records the bound format (:meth:`PromptFormat.spec`, key
``prompt_format``) and the tokenizer's fingerprint (``packsft.sidecar.tokenization_fields``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from packsft.prompt_formats.base import PromptFormat
from packsft.prompt_formats.registry import ALIASES, get_prompt_format
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint


@dataclass(frozen=True)
class TokenizationSpec:
    """How conversations become ``(tokens, targets)``: a tokenizer and a prompt format with its options.

    Attributes:
        tokenizer: local tokenizer folder or ``tokenizer.json`` (loaded by :meth:`resolve`).
        prompt_format: a name of :data:`~packsft.prompt_formats.PROMPT_FORMATS` (or ``default``).
        pad_token: replaces the format's pad token; ``None``: the format's.
        chat_template: Jinja string or file (``chat-template`` only); ``None``: the tokenizer's own.
        chat_template_kwargs: ``apply_chat_template`` keyword arguments of every conversation (a record's own
            override them).
        train_on: ``all`` assistant turns or the ``last`` of each conversation; ``None``: ``all`` (the loader:
            the packed file's, :meth:`with_packed`).
        append_eos: append EOS to every trained assistant turn; ``None``: when the template writes no end of turn
            (:func:`~packsft.prompt_formats.get_prompt_format`; the loader: the packed file's).
        allow_non_megatron: Megatron presets: tokenize a conversation Megatron-LM refuses instead of raising.
    """

    tokenizer: str
    prompt_format: str = "chat-template"
    pad_token: str | None = None
    chat_template: str | Path | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    train_on: str | None = None
    append_eos: bool | None = None
    allow_non_megatron: bool = False

    def bind(self, tokenizer: Any) -> PromptFormat:
        """The prompt format bound to ``tokenizer``.

        Raises:
            ValueError: as :func:`~packsft.prompt_formats.get_prompt_format`.
        """
        return get_prompt_format(self.prompt_format, tokenizer, pad_token=self.pad_token,
                                 chat_template=self.chat_template, train_on=self.train_on or "all",
                                 chat_template_kwargs=self.chat_template_kwargs, append_eos=self.append_eos,
                                 allow_non_megatron=self.allow_non_megatron)

    def resolve(self, tokenizer: Any = None) -> Tokenization:
        """This spec with its tokenizer (``tokenizer``, else loaded from :attr:`tokenizer`) and bound format.

        Raises:
            FileNotFoundError, ValueError: the tokenizer cannot be loaded; the format cannot be bound.
        """
        tok = tokenizer if tokenizer is not None else load_tokenizer(self.tokenizer)
        return Tokenization(self, tok, self.bind(tok))

    def with_packed(self, packed: dict[str, Any] | None) -> TokenizationSpec:
        """The options left ``None`` (``train_on``, ``chat_template_kwargs``, ``append_eos``) taken from a sidecar's
        ``prompt_format`` when it names this format, so the loader masks as the packer counted."""
        packed = packed if isinstance(packed, dict) else {}
        if packed.get("name") not in (None, ALIASES.get(self.prompt_format, self.prompt_format)):
            packed = {}  # another format: its options do not apply (the sidecar check names the format)
        return dataclasses.replace(
            self, train_on=self.train_on or packed.get("train_on", "all"),
            chat_template_kwargs=(self.chat_template_kwargs if self.chat_template_kwargs is not None
                                  else packed.get("chat_template_kwargs")),
            append_eos=self.append_eos if self.append_eos is not None else packed.get("append_eos"))


@dataclass(frozen=True, eq=False)
class Tokenization:
    """A :class:`TokenizationSpec` resolved: its ``tokenizer`` (a fast Hugging Face tokenizer) and ``fmt`` (the
    prompt format bound to it). Handed to the packer's workers and to ``PackedSFTDataset``."""

    spec: TokenizationSpec
    tokenizer: Any
    fmt: PromptFormat

    @classmethod
    def of(cls, tokenizer: Any, fmt: PromptFormat) -> Tokenization:
        """``tokenizer`` with ``fmt``, a format already bound to it; the spec is the one that binds to ``fmt``."""
        spec = TokenizationSpec(str(getattr(tokenizer, "name_or_path", "") or ""), fmt.name, fmt.pad_token,
                                fmt.chat_template, fmt.chat_template_kwargs, fmt.train_on, fmt.append_eos,
                                fmt.allow_non_megatron)
        return cls(spec, tokenizer, fmt)

    @cached_property
    def fingerprint(self) -> str:
        """:func:`packsft.tokenizer.tokenizer_fingerprint` of the tokenizer, taken once."""
        return tokenizer_fingerprint(self.tokenizer)

"""The registry of prompt formats (name -> class) and :func:`get_prompt_format`, which binds one to a tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packsft.prompt_formats.base import PromptFormat, short_sha256
from packsft.prompt_formats.chat_template import ChatTemplate
from packsft.prompt_formats.megatron import Identity, NemotronHAligned, NemotronNanoV2
from packsft.prompt_formats.passthrough import Passthrough
from packsft.prompt_formats.template import check_reserved
from packsft.tokenizer import token_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_FORMATS: dict[str, type[PromptFormat]] = {
    "identity": Identity,
    "nemotron-nano-v2": NemotronNanoV2,
    "nemotron-h-aligned": NemotronHAligned,
    "chat-template": ChatTemplate,
    "passthrough": Passthrough,
}
"""Every prompt format by name, in the order ``--prompt-format`` lists them."""

PRESETS = tuple(PROMPT_FORMATS)
MEGATRON_PRESETS = tuple(name for name, cls in PROMPT_FORMATS.items() if cls.megatron)
ALIASES = {"default": "chat-template"}
TRAIN_ON = ("all", "last")


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
        An instance of the format's class in :data:`PROMPT_FORMATS`.

    Raises:
        ValueError: unknown name; pad token not in the vocabulary; pad equal to EOS (the loss mask is 0
            wherever the label is the pad, so EOS would never be learned); no chat template available;
            ``train_on``, ``chat_template``, ``chat_template_kwargs`` or ``append_eos`` given to a format that
            ignores them.
    """
    canonical = ALIASES.get(name, name)
    if canonical not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {name!r} (choose one of {', '.join(PROMPT_FORMATS)}, or 'default')")
    cls = PROMPT_FORMATS[canonical]
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on {train_on!r}: choose one of {', '.join(TRAIN_ON)}")
    for given, capability, message in (
            (train_on != "all" or append_eos, "per_turn", "--train-on and --append-eos need prompt format "
             "chat-template or passthrough; {name} masks as Megatron-LM does"),
            (chat_template_kwargs, "templated", "--chat-template-kwargs needs prompt format chat-template, not {name}"),
            (chat_template is not None, "templated", "--chat-template needs prompt format chat-template; {name} does "
             "not render a template")):
        if given and not getattr(cls, capability):  # an option the format would ignore
            raise ValueError(message.format(name=canonical))
    check_reserved(chat_template_kwargs, "--chat-template-kwargs")
    template = cls.template_for(tokenizer, chat_template)
    pad = pad_token if pad_token is not None else cls.preset_pad or _tokenizer_pad(tokenizer, canonical)
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
    fmt = cls(name=canonical, pad_token=pad, pad_token_id=pad_id, chat_template=template,
              train_on=train_on, chat_template_kwargs=dict(chat_template_kwargs or {}) or None,
              allow_non_megatron=bool(allow_non_megatron),
              template_name=f"{label} chat template {short_sha256(template)}" if template else label)
    if cls.per_turn:
        if append_eos is None:
            append_eos = tokenizer.eos_token_id is not None and fmt.ends_silently(tokenizer)
        if append_eos and tokenizer.eos_token_id is None:
            raise ValueError("--append-eos: the tokenizer has no EOS token")
        fmt = dataclasses.replace(fmt, append_eos=bool(append_eos))
    return fmt


def _tokenizer_pad(tokenizer: PreTrainedTokenizerBase, name: str) -> str:
    """The tokenizer's pad token, or its unk when the pad is missing or equals EOS.

    Raises:
        ValueError: neither is usable.
    """
    pad = tokenizer.pad_token
    if pad is None or pad == tokenizer.eos_token:
        pad = tokenizer.unk_token
    if pad is None or pad == tokenizer.eos_token:
        raise ValueError(f"prompt format {name!r}: the tokenizer's pad token is missing or equals EOS "
                         "and it has no other unk token; choose one with --pad-token")
    return pad

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

Layout: ``base.py`` (:class:`PromptFormat`, the class every format derives from, and :class:`PerTurnFormat`),
one module per family (``megatron.py``: the presets; ``chat_template.py``; ``passthrough.py``), ``template.py``
(``apply_chat_template`` calls), ``spans.py`` (which assistant turns are trained, where they lie),
``registry.py`` (:data:`PROMPT_FORMATS`, name -> class, and :func:`get_prompt_format`) and ``tokens.py``
(encoding, targets); ``spec.py`` holds the tokenization contract (:class:`TokenizationSpec`, resolved as
:class:`Tokenization`). A new format is a subclass of :class:`PromptFormat` (or :class:`PerTurnFormat`) entered in
:data:`PROMPT_FORMATS` (``docs/prompt_formats.md``, "Adding a format").
"""

from packsft.layout import IGNORE_INDEX
from packsft.prompt_formats.base import (
    NonMegatronError,
    PerTurnFormat,
    PromptFormat,
    PromptFormatError,
    Segment,
    unrendered,
)
from packsft.prompt_formats.registry import (
    ALIASES,
    MEGATRON_PRESETS,
    PRESETS,
    PROMPT_FORMATS,
    TRAIN_ON,
    get_prompt_format,
)
from packsft.prompt_formats.spans import trained_turns
from packsft.prompt_formats.spec import Tokenization, TokenizationSpec
from packsft.prompt_formats.template import RESERVED_TEMPLATE_KWARGS, TemplateShape, template_shape
from packsft.prompt_formats.tokens import (
    count_conversation_tokens,
    render_segments,
    targets_of_runs,
    tokenize_conversation,
    tokenize_conversations,
    tokenize_segments,
)

__all__ = [
    "ALIASES",
    "IGNORE_INDEX",
    "MEGATRON_PRESETS",
    "PRESETS",
    "PROMPT_FORMATS",
    "RESERVED_TEMPLATE_KWARGS",
    "TRAIN_ON",
    "NonMegatronError",
    "PerTurnFormat",
    "PromptFormat",
    "PromptFormatError",
    "Segment",
    "TemplateShape",
    "Tokenization",
    "TokenizationSpec",
    "count_conversation_tokens",
    "get_prompt_format",
    "render_segments",
    "targets_of_runs",
    "template_shape",
    "tokenize_conversation",
    "tokenize_conversations",
    "tokenize_segments",
    "trained_turns",
    "unrendered",
]

"""The prompt-format registry: every name binds to its class; a class entered in it is a working format."""

import pytest

from packsft.prompt_formats import (
    IGNORE_INDEX,
    MEGATRON_PRESETS,
    PRESETS,
    PROMPT_FORMATS,
    PerTurnFormat,
    PromptFormat,
    PromptFormatError,
    Segment,
    Tokenization,
    get_prompt_format,
    tokenize_conversation,
    tokenize_conversations,
)
from packsft.prompt_formats.spans import check_masks, trained_turns
from packsft.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def qwen(tokenizer_dir):
    return load_tokenizer(tokenizer_dir("qwen2.5"))


class Plain(PerTurnFormat):
    """The example of docs/prompt_formats.md, "Adding a format"."""

    def ends_silently(self, tokenizer):
        return True

    def render(self, messages, tools, tokenizer, chat_template_kwargs):
        check_masks(messages)
        turns = set(trained_turns(messages, self.train_on))
        out, prompt, first = [], "", 0
        for i, m in enumerate(messages):
            if i in turns:
                out += [Segment(prompt + "Assistant: ", first, False), Segment(m["content"], i, True)]
                prompt, first = "\n", i + 1
            else:
                prompt += f"{m['role'].title()}: {m.get('content') or ''}\n"
        return out + [Segment(prompt, first, False)]


def test_every_name_binds_to_its_class(qwen):
    assert PRESETS == ("identity", "nemotron-nano-v2", "nemotron-h-aligned", "chat-template", "passthrough")
    assert PRESETS == tuple(PROMPT_FORMATS)
    assert MEGATRON_PRESETS == ("identity", "nemotron-nano-v2", "nemotron-h-aligned")
    for name, cls in PROMPT_FORMATS.items():
        fmt = get_prompt_format(name, qwen, pad_token="<|endoftext|>")
        assert type(fmt) is cls and issubclass(cls, PromptFormat) and fmt.name == name
    assert type(get_prompt_format("default", qwen)) is PROMPT_FORMATS["chat-template"]


def test_a_format_entered_in_the_registry_packs(qwen, monkeypatch):
    monkeypatch.setitem(PROMPT_FORMATS, "plain", Plain)
    fmt = get_prompt_format("plain", qwen, train_on="last")
    assert fmt.append_eos and fmt.spec()["name"] == "plain" and fmt.missing_stop_signal(qwen) is False
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "done"}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(qwen, fmt))
    assert qwen.decode(tokens) == "System: s\nUser: hi\nAssistant: yo\nUser: and?\nAssistant: done<|im_end|>\n"
    assert qwen.decode([t for t in targets if t != IGNORE_INDEX]) == "done<|im_end|>"
    tool_only = msgs[:2] + [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]
    got = tokenize_conversations([(msgs, None, None), (tool_only, None, None)], Tokenization.of(qwen, fmt))
    assert got[0] == (tokens, targets) and isinstance(got[1], PromptFormatError)
    assert str(got[1]) == ("messages[2]: empty assistant turn (prompt format plain does not render tool_calls; use a "
                           "chat template that does)")
    with pytest.raises(ValueError, match="--chat-template needs prompt format chat-template; plain does not render"):
        get_prompt_format("plain", qwen, chat_template="{{ messages }}")

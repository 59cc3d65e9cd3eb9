import json

import pytest
from test_dataset import load_cached  # each tokenizer loaded once per process

from packsft.conversation import parse_record
from packsft.prompt_formats import (
    IGNORE_INDEX,
    NonMegatronError,
    PromptFormatError,
    Tokenization,
    count_conversation_tokens,
    get_prompt_format,
    render_segments,
    tokenize_conversation,
    tokenize_conversations,
    unrendered,
)
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

CONV = [
    {"role": "system", "content": "  Be kind. /think "},
    {"role": "user", "content": "Hi /no_think there "},
    {"role": "assistant", "content": " Hello! "},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def nemo(tokenizer_dir):
    return load_cached(tokenizer_dir("nemotron-h-layout-tekken"))


@pytest.fixture(scope="module")
def qwen(tokenizer_dir):
    return load_cached(tokenizer_dir("qwen2.5"))


def _trained_text(tok, tokens, targets):
    return tok.decode([t for t in targets if t != IGNORE_INDEX])


def test_nemotron_nano_v2_text_and_mask(nemo):
    fmt = get_prompt_format("nemotron-nano-v2", nemo)
    tokens, targets = tokenize_conversation(CONV, Tokenization.of(nemo, fmt))
    assert nemo.decode(tokens) == (
        "<SPECIAL_10>System\nBe kind.\n<SPECIAL_11>User\nHi  there\n"
        "<SPECIAL_11>Assistant\nHello!\n<SPECIAL_12>\n<SPECIAL_11>User\n2+2?\n<SPECIAL_11>Assistant\n4\n<SPECIAL_12>\n")
    # first 3 tokens of each assistant turn ("<SPECIAL_11>", "Assistant", "\n") are masked
    assert _trained_text(nemo, tokens, targets) == "Hello!\n<SPECIAL_12>\n4\n<SPECIAL_12>\n"
    assert fmt.pad_token == "<unk>" and fmt.pad_token_id == 0
    assert all(t == g or g == IGNORE_INDEX for t, g in zip(tokens, targets))


def test_nemotron_h_aligned_text_and_mask(nemo):
    fmt = get_prompt_format("nemotron-h-aligned", nemo)
    tokens, targets = tokenize_conversation(CONV, Tokenization.of(nemo, fmt))
    assert nemo.decode(tokens) == (
        "<SPECIAL_10>System\nBe kind. /think\n<SPECIAL_11>User\nHi /no_think there\n<SPECIAL_11>Assistant\n"
        "Hello!\n<SPECIAL_11>User\n2+2?\n<SPECIAL_11>Assistant\n4\n")
    assert _trained_text(nemo, tokens, targets) == "Hello!\n4\n"
    assert fmt.pad_token == "<SPECIAL_233>" and fmt.pad_token_id == 233


def test_identity_trains_assistant_turns_only_without_bos_or_eos(nemo):
    fmt = get_prompt_format("identity", nemo)
    conv = [dict(m, content=m["content"].strip() + "\n") for m in CONV]  # no token across turns
    tokens, targets = tokenize_conversation(conv, Tokenization.of(nemo, fmt))
    assert nemo.decode(tokens) == "".join(m["content"] for m in conv)
    assert nemo.decode([t for t in targets if t != IGNORE_INDEX]) == "Hello!\n4\n"
    assert tokens[0] != nemo.bos_token_id and tokens[-1] != nemo.eos_token_id


def test_identity_refuses_a_token_across_turns_unless_allowed(nemo):
    with pytest.raises(NonMegatronError, match=r"messages\[1\]: a token crosses .*--allow-non-megatron"):
        tokenize_conversation(CONV, Tokenization.of(nemo, get_prompt_format("identity", nemo)))
    lenient = get_prompt_format("identity", nemo, allow_non_megatron=True)
    tokens, targets = tokenize_conversation(CONV, Tokenization.of(nemo, lenient))
    assert tokens == [t for m in CONV for t in nemo.encode(m["content"], add_special_tokens=False)]
    assert nemo.decode([t for t in targets if t != IGNORE_INDEX]) == " Hello! 4"


def test_nemotron_tool_turns_render_to_nothing_and_tool_only_assistant_is_an_error(nemo):
    fmt = get_prompt_format("nemotron-h-aligned", nemo)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    msgs = [CONV[0], CONV[1], call, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(PromptFormatError, match=r"messages\[2\]: empty assistant turn .*use chat-template"):
        tokenize_conversation(msgs, Tokenization.of(nemo, fmt))
    tool_only = [CONV[0], CONV[1], {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    with_tool = tool_only[:3] + [{"role": "tool", "content": "ignored"}] + tool_only[3:]
    assert [s.text for s in render_segments(with_tool, None, nemo, fmt)] == \
        [s.text for s in render_segments(tool_only, None, nemo, fmt)]


def test_passthrough_refuses_a_tool_call_turn_it_would_train_as_an_empty_reply(qwen):
    """passthrough renders contents only: a call without content trained only its EOS after the prompt."""
    fmt = get_prompt_format("passthrough", qwen, append_eos=True)
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    msgs = [CONV[0], CONV[1], call, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(PromptFormatError, match=r"messages\[2\]: empty assistant turn \(prompt format passthrough "
                                                r"does not render tool_calls; use a chat template that does\)"):
        tokenize_conversation(msgs, Tokenization.of(qwen, fmt))
    tokenize_conversation([*msgs[:2], {**call, "content": "Calling f."}, *msgs[3:]],  # content: trained
                          Tokenization.of(qwen, fmt))
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n{% endfor %}" \
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"   # a template without tool calls
    with pytest.raises(PromptFormatError, match=r"messages\[2\]: empty assistant turn \(the chat template does not "
                                                r"render tool_calls"):
        tokenize_conversation(msgs, Tokenization.of(qwen, get_prompt_format("chat-template", qwen,
                                                                            chat_template=plain)))
    tokenize_conversation(msgs, Tokenization.of(qwen, get_prompt_format("chat-template", qwen)))  # Qwen2.5's renders it


def test_what_a_format_does_not_render_is_named(qwen, nemo, tokenizer_dir):
    smol = load_cached(tokenizer_dir("smollm2-135m-instruct"))
    call = {"role": "assistant", "content": "Calling f.",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    msgs = [CONV[0], CONV[1], call, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    assert unrendered(msgs, tools, get_prompt_format("chat-template", qwen)) == []   # Qwen2.5 renders both
    assert unrendered(CONV, None, get_prompt_format("passthrough", qwen)) == []
    for fmt, words in ((get_prompt_format("chat-template", smol), "the chat template"),   # reads neither
                       (get_prompt_format("passthrough", qwen), "prompt format passthrough"),
                       (get_prompt_format("identity", nemo), "prompt format identity")):
        got = unrendered(msgs, tools, fmt)
        assert [k for k, _ in got] == ["tools_not_rendered", "tool_calls_not_rendered"]
        assert got[0][1].startswith(f"tools: 1 tool schema(s) that {words} does not render")
        assert got[1][1].startswith(f"tool_calls of 1 assistant turn(s) that {words} does not render")
    assert [k for k, _ in unrendered(CONV, tools, get_prompt_format("chat-template", smol))] == ["tools_not_rendered"]
    ext = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% if loop.index > 9 %}"
           "{% break %}{% endif %}{% endfor %}")   # transformers' extensions: parsed as transformers parses
    fmt = get_prompt_format("chat-template", qwen, chat_template=ext)
    assert [k for k, _ in unrendered(msgs, tools, fmt)] == ["tools_not_rendered", "tool_calls_not_rendered"]


@pytest.mark.parametrize("content", ["", "   \n "])
@pytest.mark.parametrize("name", ["nemotron-nano-v2", "nemotron-h-aligned", "chat-template"])
def test_empty_or_whitespace_assistant_is_an_error(nemo, qwen, name, content):
    tok = qwen if name == "chat-template" else nemo
    msgs = [CONV[0], CONV[1], {"role": "assistant", "content": content}]
    with pytest.raises(PromptFormatError, match=r"messages\[2\]: empty assistant turn"):
        tokenize_conversation(msgs, Tokenization.of(tok, get_prompt_format(name, tok)))


def test_empty_user_and_unicode_are_fine(qwen):
    fmt = get_prompt_format("chat-template", qwen)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": ""},
            {"role": "assistant", "content": "Grüße 🙂 — 東京\r\nbye"}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(qwen, fmt))
    assert _trained_text(qwen, tokens, targets) == "Grüße 🙂 — 東京\r\nbye<|im_end|>"


def test_chat_template_trains_assistant_turns_through_end_of_turn(qwen):
    fmt = get_prompt_format("chat-template", qwen)
    tokens, targets = tokenize_conversation(CONV, Tokenization.of(qwen, fmt))
    assert _trained_text(qwen, tokens, targets) == " Hello! <|im_end|>4<|im_end|>"
    # the newline after <|im_end|> and everything else is masked
    assert qwen.decode(tokens).endswith("<|im_start|>assistant\n4<|im_end|>\n")
    assert targets[-1] == IGNORE_INDEX
    assert fmt.pad_token == "<|endoftext|>"


def test_chat_template_counts_equal_a_fresh_apply_chat_template(qwen, shared_data):
    """Packer counts == transformers' own tokenization of the same conversation (tool rows included)."""
    fmt = get_prompt_format("chat-template", qwen)
    for name in ("tools/glaive_toolcall_en_demo", "tools/bfcl_v4_ast", "chat/hh_rlhf_harmless_base_test"):
        with open(shared_data / f"{name}.messages.jsonl") as f:
            for i, line in zip(range(40), f):
                conv = parse_record(json.loads(line), name, i + 1)
                msgs = json.loads(json.dumps(conv.messages))
                for m in msgs:
                    for c in m.get("tool_calls") or []:
                        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                fresh = qwen.apply_chat_template(msgs, tools=conv.tools, tokenize=True, return_dict=False)
                count = count_conversation_tokens(conv.messages, Tokenization.of(qwen, fmt), conv.tools)
                assert count == len(fresh), (name, i)


def test_chat_template_that_moves_the_system_prompt_is_handled(tokenizer_dir):
    tok = load_cached(tokenizer_dir("mistral-nemo"))
    fmt = get_prompt_format("chat-template", tok)
    tokens, targets = tokenize_conversation(CONV, Tokenization.of(tok, fmt))
    assert _trained_text(tok, tokens, targets) == " Hello! </s>4</s>"


@pytest.mark.parametrize("reply", ["\ue000marked\ue001", "\ue000", "\ue001\ue000x"])
def test_a_reply_starting_with_a_private_use_character_is_trained_whole(tokenizer_dir, reply):
    """Such a content takes the per-turn path, whose probe turn was U+E000: a reply starting with it lost that
    character to the prompt (and a reply of only it trained nothing, not even the end of turn)."""
    tok = load_cached(tokenizer_dir("mistral-nemo"))
    fmt = get_prompt_format("chat-template", tok)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": reply}]
    assert _trained_text(tok, *tokenize_conversation(msgs, Tokenization.of(tok, fmt))) == f"{reply}</s>"


def test_chat_template_text_that_merges_across_turns_is_encoded_per_part(tokenizer_dir):
    """A template that glues turns together: each part is encoded alone, no rejection (was an error)."""
    tok = load_cached(tokenizer_dir("gpt2"))
    fmt = get_prompt_format("chat-template", tok, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
                            pad_token="!")
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hel"},
            {"role": "assistant", "content": "lo world"}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(tok, fmt))
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert fmt.append_eos  # the template writes nothing after the reply: EOS is the stop signal
    assert tokens == enc("hel") + enc("lo world") + [tok.eos_token_id] != enc("hello world")
    assert _trained_text(tok, tokens, targets) == "lo world<|endoftext|>"


def test_preset_token_crossing_a_boundary_names_the_message_and_both_sides(monkeypatch, tokenizer_dir):
    import packsft.prompt_formats.megatron as pf

    tok = load_cached(tokenizer_dir("gpt2"))
    fmt = get_prompt_format("nemotron-h-aligned", tok, pad_token="!")
    monkeypatch.setattr(pf, "_nemotron_segments", lambda messages, name: [
        pf.Segment("A: hel", 1, False), pf.Segment("lo world", 2, True), pf.Segment(" bye", 3, False)])
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "hel"},
            {"role": "assistant", "content": "lo world"}, {"role": "user", "content": "bye"}]
    with pytest.raises(PromptFormatError) as err:
        tokenize_conversation(msgs, Tokenization.of(tok, fmt))
    text = str(err.value)
    assert text.startswith("messages[2]: a token crosses the boundary between 'A: hel' and 'lo world'")
    assert "token ' hello'" in text


def test_template_failure_is_a_clear_error(tokenizer_dir):
    tok = load_cached(tokenizer_dir("smollm2-135m-instruct"))
    strict = ("{% for m in messages %}{% if m.role == 'user' and loop.index0 > 1 %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    fmt = get_prompt_format("chat-template", tok, chat_template=strict)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "c"}]
    with pytest.raises(PromptFormatError, match="chat template failed: .*roles must alternate"):
        tokenize_conversation(msgs, Tokenization.of(tok, fmt))


def test_pad_token_rules(tokenizer_dir, nemo):
    smol = load_cached(tokenizer_dir("smollm2-135m-instruct"))
    # SmolLM2's own pad is EOS: the chat-template default falls back to its unk token
    assert get_prompt_format("chat-template", smol).pad_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="equals the EOS token"):
        get_prompt_format("chat-template", smol, pad_token="<|im_end|>")
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        get_prompt_format("identity", nemo, pad_token="<nope>")
    assert get_prompt_format("identity", nemo, pad_token="<pad>").pad_token_id == 4
    with pytest.raises(ValueError, match="unknown prompt format"):
        get_prompt_format("llama", nemo)
    assert get_prompt_format("default", smol).name == "chat-template"


def test_custom_template_file_and_missing_template(tmp_path, tokenizer_dir):
    tok = load_cached(tokenizer_dir("gpt2"))
    with pytest.raises(ValueError, match="no chat template"):
        get_prompt_format("chat-template", tok, pad_token="!")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}")
    fmt = get_prompt_format("chat-template", tok, chat_template=f, pad_token="!")
    assert fmt.spec()["chat_template_sha256"] and fmt.chat_template.startswith("{% for")
    with pytest.raises(ValueError, match="neither a Jinja template nor an existing file"):
        get_prompt_format("chat-template", tok, chat_template=tmp_path / "missing.jinja", pad_token="!")
    f.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")   # once here, not per conversation
    with pytest.raises(ValueError, match=r"^--chat-template is not a valid Jinja template: unexpected '}' "
                                         r"\(template line 2\)$"):
        get_prompt_format("chat-template", tok, chat_template=f, pad_token="!")
    loops = "{% for m in messages %}{{ m.content }}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
    assert get_prompt_format("chat-template", tok, chat_template=loops, pad_token="!").chat_template == loops


def test_fingerprint_differs_between_tokenizers(tokenizer_dir, nemo, qwen):
    assert tokenizer_fingerprint(nemo) != tokenizer_fingerprint(qwen)
    assert tokenizer_fingerprint(qwen) == tokenizer_fingerprint(load_tokenizer(tokenizer_dir("qwen2.5")))
    file_tok = load_tokenizer(tokenizer_dir("qwen2.5") / "tokenizer.json")
    assert tokenizer_fingerprint(file_tok) == tokenizer_fingerprint(qwen)


def test_fingerprint_hashes_the_serialized_tokenizer(qwen, nemo):
    """The fingerprint is the SHA-256 of ``to_str()``'s JSON however it is taken (pickle state or text), so
    sidecars written before and after agree."""
    import hashlib

    class TextOnly:  # a backend whose pickle state is not the JSON bytes
        def __init__(self, backend):
            self.backend = backend

        def __getstate__(self):
            return {"json": self.backend.to_str()}

        def to_str(self):
            return self.backend.to_str()

    for tok in (qwen, nemo):
        want = hashlib.sha256(tok.backend_tokenizer.to_str().encode("utf-8")).hexdigest()[:16]
        assert tokenizer_fingerprint(tok) == want
        text_only = type("Tok", (), {"backend_tokenizer": TextOnly(tok.backend_tokenizer)})()
        assert tokenizer_fingerprint(text_only) == want


@pytest.mark.parametrize("name", ["qwen2.5", "mistral-nemo"])
def test_marker_fast_path_equals_turn_by_turn_rendering(monkeypatch, tokenizer_dir, shared_data, name):
    """The one-render marker path gives exactly the spans of the per-turn generation-prompt rendering."""
    import packsft.prompt_formats.chat_template as pf

    tok = load_cached(tokenizer_dir(name))
    fmt = get_prompt_format("chat-template", tok)
    convs = []
    for ds in ("chat/chitchat", "chat/hh_rlhf_harmless_base_test"):
        with open(shared_data / f"{ds}.messages.jsonl") as f:
            convs += [parse_record(json.loads(line)) for _, line in zip(range(15), f)]
    calls = []
    real_turn_spans = pf._turn_spans
    monkeypatch.setattr(pf, "_turn_spans", lambda *a: calls.append(1) or real_turn_spans(*a))
    fast = [tokenize_conversation(c.messages, Tokenization.of(tok, fmt), c.tools) for c in convs]
    assert not calls  # the fast path was taken for every one of these conversations
    monkeypatch.setattr(pf, "_marked_spans", lambda *a, **k: None)
    slow = [tokenize_conversation(c.messages, Tokenization.of(tok, fmt), c.tools) for c in convs]
    assert fast == slow and len(calls) == len(convs)


@pytest.mark.parametrize("tok_name,fmt_name", [("qwen2.5", "chat-template"), ("nemotron-h-layout-tekken", "identity"),
                                               ("nemotron-h-layout-tekken", "nemotron-h-aligned")])
def test_batched_tokenization_equals_one_at_a_time(tokenizer_dir, shared_data, tok_name, fmt_name, monkeypatch):
    """tokenize_conversations (the packer's) gives each conversation's tokenize_conversation result, or its error,
    encoding each distinct text of the batch once (the text after every last turn repeats in each)."""
    import packsft.prompt_formats.tokens as pf

    tok = load_cached(tokenizer_dir(tok_name))
    fmt = get_prompt_format(fmt_name, tok)
    convs = []
    for ds in ("chat/hh_rlhf_harmless_base_test", "tools/glaive_toolcall_en_demo"):
        with open(shared_data / f"{ds}.messages.jsonl") as f:
            convs += [parse_record(json.loads(line)) for _, line in zip(range(20), f)]
    empty_reply = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}
    convs.insert(3, parse_record(empty_reply))
    batch = [(c.messages, c.tools, {"x": 1} if i % 2 and fmt_name == "chat-template" else None)
             for i, c in enumerate(convs)]
    calls: list[list[str]] = []
    encode = pf._encode
    monkeypatch.setattr(pf, "_encode", lambda t, texts: (calls.append(list(texts)), encode(t, texts))[1])
    got = tokenize_conversations(batch, Tokenization.of(tok, fmt))
    assert len(calls) == 1 and len(set(calls[0])) == len(calls[0])
    monkeypatch.setattr(pf, "_encode", encode)

    def one(messages, tools, kwargs):
        try:
            return tokenize_conversation(messages, Tokenization.of(tok, fmt), tools, kwargs)
        except PromptFormatError as e:
            return e

    want = [one(*b) for b in batch]
    assert [type(g) for g in got] == [type(w) for w in want]
    assert [str(g) if isinstance(g, Exception) else g for g in got] == \
        [str(w) if isinstance(w, Exception) else w for w in want]
    assert sum(isinstance(w, PromptFormatError) for w in want) >= 1 and sum(isinstance(w, tuple) for w in want) >= 10
    assert tokenize_conversations([], Tokenization.of(tok, fmt)) == []
    known = [{} for _ in batch]
    with_known = tokenize_conversations(batch, Tokenization.of(tok, fmt), known)
    assert [str(g) if isinstance(g, Exception) else g for g in with_known] == \
        [str(w) if isinstance(w, Exception) else w for w in want]
    assert all(d for d, w in zip(known, want) if isinstance(w, tuple))


@pytest.mark.parametrize("tok_name,fmt_name", [("qwen2.5", "chat-template"), ("nemotron-h-layout-tekken", "identity")])
def test_known_segment_ids_are_reused_and_give_the_same_tokens(tokenizer_dir, shared_data, tok_name, fmt_name,
                                                               monkeypatch):
    """The packer's own-row cuts tokenize prefixes of a conversation with its ``known`` ids: the same result as
    without them, and only the texts the cut changed are encoded again."""
    import packsft.prompt_formats.tokens as pf

    tok = load_cached(tokenizer_dir(tok_name))
    fmt = get_prompt_format(fmt_name, tok)
    with open(shared_data / "chat/chitchat.messages.jsonl") as f:
        conv = parse_record(json.loads(next(f)))
    known: dict = {}
    whole = tokenize_conversations([(conv.messages, None, None)], Tokenization.of(tok, fmt), [known])[0]
    assert whole == tokenize_conversation(conv.messages, Tokenization.of(tok, fmt)) and known
    encoded: list[str] = []
    encode = pf._encode
    monkeypatch.setattr(pf, "_encode", lambda t, texts: (encoded.extend(texts), encode(t, texts))[1])
    for keep in (len(conv.messages) - 1, 9, 4):  # prefixes, the last kept message cut short (as the packer cuts)
        msgs = conv.messages[:keep] + [{**conv.messages[keep], "content": conv.messages[keep]["content"][:7]}]
        seen = set(known)
        encoded.clear()
        got = tokenize_conversation(msgs, Tokenization.of(tok, fmt), known=known)
        assert encoded and not seen & set(encoded)  # only new texts
        monkeypatch.setattr(pf, "_encode", encode)
        assert got == tokenize_conversation(msgs, Tokenization.of(tok, fmt))
        monkeypatch.setattr(pf, "_encode", lambda t, texts: (encoded.extend(texts), encode(t, texts))[1])
    if fmt_name == "chat-template":  # segments encoded alone: the kept turns were not encoded again
        assert sum(map(len, encoded)) < sum(len(m["content"]) for m in msgs) / 2
    else:  # the presets' whole text changes with every cut: not kept
        assert max(map(len, known)) < len(encoded[0])
    with pytest.raises(ValueError, match="zip"):  # one known dict per conversation
        tokenize_conversations([(msgs, None, None)] * 2, Tokenization.of(tok, fmt), [{}])


def test_a_lone_surrogate_decoded_from_tool_call_arguments_is_a_prompt_format_error(qwen):
    """Arguments given as a JSON string are decoded again for the template; a "\\ud800" there is not text (the
    Rust tokenizer raised TypeError): that conversation fails, the others of its batch do not."""
    fmt = get_prompt_format("chat-template", qwen)
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": "\\ud800"}'}}
    bad = parse_record({"messages": [{"role": "user", "content": "q"},
                                     {"role": "assistant", "content": None, "tool_calls": [call]},
                                     {"role": "tool", "content": "t"}, {"role": "assistant", "content": "ok"}]})
    with pytest.raises(PromptFormatError, match="lone UTF-16 surrogate \\(U\\+D800"):
        tokenize_conversation(bad.messages, Tokenization.of(qwen, fmt))
    good = parse_record({"messages": CONV})
    got = tokenize_conversations([(good.messages, None, None), (bad.messages, None, None),
                                  (good.messages, None, None)], Tokenization.of(qwen, fmt))
    assert got[0] == got[2] == tokenize_conversation(good.messages, Tokenization.of(qwen, fmt))
    assert isinstance(got[1], PromptFormatError) and "surrogate" in str(got[1])


def test_template_data_equals_transformers_conversion():
    """The direct copy of all-string messages gives what apply_chat_template hands the template."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages, _plain_template_data

    from packsft.prompt_formats.chat_template import _template_data

    cases = [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": None}],
        [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "weight": 1}],
        [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": {"x": 1, "y": None}}}]}, {"role": "tool", "content": "3"}],
    ]
    for msgs in cases:
        assert _template_data(msgs) == _plain_template_data(_normalize_chat_messages(msgs))


def test_traced_render_equals_apply_chat_template(qwen):
    from packsft.prompt_formats.chat_template import _render_traced

    fmt = get_prompt_format("chat-template", qwen)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": None},
            {"role": "assistant", "content": "a"}]
    marked = _render_traced(qwen, fmt, msgs, [2], None, {})
    assert marked.replace("\ue000", "").replace("\ue001", "") == qwen.apply_chat_template(msgs, tokenize=False)


# ---------------------------------------------------------------- per-part rule, masks, kwargs, stop signal
def _enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", ["qwen2.5", "smollm2-135m-instruct"])
def test_reply_starting_with_newlines_trains_exactly_what_follows_the_generation_prompt(tokenizer_dir, name):
    """The header and "\n\n" merge into one BPE token in the whole string; per part they never do."""
    tok = load_cached(tokenizer_dir(name))
    fmt = get_prompt_format("chat-template", tok)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "\n\nHello there."}]
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(msgs, tokenize=False)
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(tok, fmt))
    assert _enc(tok, whole) != tokens                            # the whole string merges across the header
    reply = "\n\nHello there.<|im_end|>"
    assert whole.startswith(prompt + reply)
    assert tokens == _enc(tok, prompt) + _enc(tok, reply) + _enc(tok, whole[len(prompt + reply):])
    assert [t for t in targets if t != IGNORE_INDEX] == _enc(tok, reply)


def test_prompt_response_records_whose_prompt_ends_in_a_space(qwen):
    fmt = get_prompt_format("chat-template", qwen)
    conv = parse_record({"prompt": "Translate: ", "response": " Bonjour"}, input_key="prompt", output_key="response")
    tokens, targets = tokenize_conversation(conv.messages, Tokenization.of(qwen, fmt))
    assert _trained_text(qwen, tokens, targets) == " Bonjour<|im_end|>"


@pytest.mark.parametrize("name", ["qwen2.5", "smollm2-135m-instruct", "mistral-nemo"])
def test_empty_assistant_turn_in_a_multi_turn_conversation_trains_nothing_and_keeps_the_others(tokenizer_dir,
                                                                                                name):
    tok = load_cached(tokenizer_dir(name))
    fmt = get_prompt_format("chat-template", tok)
    eot = "</s>" if name == "mistral-nemo" else "<|im_end|>"
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "Yes."}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(tok, fmt))
    assert _trained_text(tok, tokens, targets) == f"Yes.{eot}"
    assert tok.decode(tokens) == tok.apply_chat_template(msgs, tokenize=False)


def test_weight_zero_and_train_on_last(qwen):
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "One.", "weight": 0}, {"role": "user", "content": "b"},
            {"role": "assistant", "content": "Two."}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "Three."}]
    fmt = get_prompt_format("chat-template", qwen)
    assert _trained_text(qwen, *tokenize_conversation(msgs, Tokenization.of(qwen, fmt))) == \
        "Two.<|im_end|>Three.<|im_end|>"
    last = get_prompt_format("chat-template", qwen, train_on="last")
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(qwen, last))
    assert _trained_text(qwen, tokens, targets) == "Three.<|im_end|>"
    assert qwen.decode(tokens) == qwen.apply_chat_template(msgs, tokenize=False)
    assert last.spec()["train_on"] == "last" and fmt.spec()["train_on"] == "all"
    with pytest.raises(ValueError, match="need prompt format chat-template or passthrough"):
        get_prompt_format("nemotron-h-aligned", qwen, train_on="last", pad_token="<|endoftext|>")
    with pytest.raises(ValueError, match="train_on 'first'"):
        get_prompt_format("chat-template", qwen, train_on="first")


def test_weight_zero_is_refused_by_the_megatron_presets(nemo):
    fmt = get_prompt_format("nemotron-h-aligned", nemo)
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "weight": 0}]
    with pytest.raises(PromptFormatError, match=r"messages\[2\]: 'weight: 0' needs prompt format chat-template"):
        tokenize_conversation(msgs, Tokenization.of(nemo, fmt))
    assert tokenize_conversation([dict(m, weight=1) if m["role"] == "assistant" else m for m in msgs],
                                 Tokenization.of(nemo, fmt))


THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
         "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template_per_format_and_per_record(qwen):
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    plain = get_prompt_format("chat-template", qwen, chat_template=THINK)
    off = get_prompt_format("chat-template", qwen, chat_template=THINK, chat_template_kwargs={"enable_thinking": False})
    assert off.spec()["chat_template_kwargs"] == {"enable_thinking": False}
    assert plain.spec()["chat_template_kwargs"] == {}
    # the kwargs change what the generation prompt is; this template then does not render the turn after it
    assert tokenize_conversation(msgs, Tokenization.of(qwen, plain))
    with pytest.raises(PromptFormatError, match="generation header"):
        tokenize_conversation(msgs, Tokenization.of(qwen, off))
    with pytest.raises(PromptFormatError, match="generation header"):
        tokenize_conversation(msgs, Tokenization.of(qwen, plain), chat_template_kwargs={"enable_thinking": False})
    assert tokenize_conversation(msgs, Tokenization.of(qwen, off), chat_template_kwargs={"enable_thinking": True})
    with pytest.raises(ValueError, match="needs prompt format chat-template"):
        get_prompt_format("passthrough", qwen, chat_template_kwargs={"x": 1})
    for name in ("passthrough", "identity"):  # before: accepted, ignored, and recorded in the report's settings
        with pytest.raises(ValueError, match=f"--chat-template needs prompt format chat-template; {name} does not"):
            get_prompt_format(name, qwen, chat_template="{{ messages }}")
    # what packsft sets itself is refused, in the format's kwargs and in a record's
    with pytest.raises(PromptFormatError, match=r"--chat-template-kwargs sets 'add_generation_prompt', 'tokenize'"):
        get_prompt_format("chat-template", qwen, chat_template_kwargs={"tokenize": False, "add_generation_prompt": 1})
    with pytest.raises(PromptFormatError, match="the record's chat_template_kwargs sets 'return_dict'"):
        tokenize_conversation(msgs, Tokenization.of(qwen, plain), chat_template_kwargs={"return_dict": True})
    with pytest.raises(PromptFormatError, match="sets 'messages', 'sanitize_control_tokens'"):   # were per-line errors
        get_prompt_format("chat-template", qwen, chat_template_kwargs={"messages": [], "sanitize_control_tokens": 1})


GLM = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_template_without_end_of_turn_trains_eos_by_default_or_reports_it(qwen):
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "Bye"}]
    fmt = get_prompt_format("chat-template", qwen, chat_template=GLM)
    assert fmt.append_eos and fmt.spec()["append_eos"] and not fmt.missing_stop_signal(qwen)
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(qwen, fmt))
    assert _trained_text(qwen, tokens, targets) == "Hi<|im_end|>Bye<|im_end|>"
    off = get_prompt_format("chat-template", qwen, chat_template=GLM, append_eos=False)
    assert off.missing_stop_signal(qwen)
    assert _trained_text(qwen, *tokenize_conversation(msgs, Tokenization.of(qwen, off))) == "HiBye"
    chatml = get_prompt_format("chat-template", qwen)
    assert not chatml.append_eos and not chatml.missing_stop_signal(qwen)


def test_passthrough_concatenates_contents_and_trains_the_assistant_contents(qwen):
    fmt = get_prompt_format("passthrough", qwen)
    msgs = [{"role": "system", "content": "<|im_start|>system\nS<|im_end|>\n"},
            {"role": "user", "content": "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"},
            {"role": "assistant", "content": "A<|im_end|>"}, {"role": "user", "content": "\nmore"},
            {"role": "assistant", "content": " B"}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(qwen, fmt))
    assert qwen.decode(tokens) == "".join(m["content"] for m in msgs) + "<|im_end|>"  # EOS after " B" only
    assert _trained_text(qwen, tokens, targets) == "A<|im_end|> B<|im_end|>"
    assert fmt.append_eos and fmt.chat_template is None and fmt.pad_token == "<|endoftext|>"
    assert _trained_text(qwen, *tokenize_conversation(msgs, Tokenization.of(qwen, get_prompt_format(
        "passthrough", qwen, append_eos=False)))) == "A<|im_end|> B"


def test_mistral_multi_turn_tool_conversation_is_located_without_prefix_stability(tokenizer_dir):
    tok = load_cached(tokenizer_dir("mistral-nemo"))
    fmt = get_prompt_format("chat-template", tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}, call,
            {"role": "tool", "tool_call_id": "call00001", "content": "2"}, {"role": "assistant", "content": "two"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]
    tokens, targets = tokenize_conversation(msgs, Tokenization.of(tok, fmt), tools)
    assert _trained_text(tok, tokens, targets) == \
        '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "call00001"}]</s>two</s>ok</s>'
    assert tok.decode(tokens) == tok.apply_chat_template(json.loads(json.dumps(msgs).replace(
        '"{\\"x\\": 1}"', '{"x": 1}')), tools=tools, tokenize=False)


def test_a_pad_token_the_tokenizer_lacks_says_which_and_what_to_pass(tokenizer_dir):
    smollm2 = load_cached(tokenizer_dir("smollm2-135m-instruct"))  # no <unk>
    with pytest.raises(ValueError, match=r"the identity prompt format's pad token: token '<unk>' is not in the "
                                         r"tokenizer's vocabulary; choose one this tokenizer has with --pad-token"):
        get_prompt_format("identity", smollm2)
    with pytest.raises(ValueError, match=r"^--pad-token: token '<nope>' is not"):
        get_prompt_format("chat-template", smollm2, pad_token="<nope>")


_CALLS = ("{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}({{ c.function.arguments | tojson }})</call>"
          "{% endfor %}")
_OTHER = "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
# one hand-made template per shape the turn-span rule must handle (docs/prompt_formats.md, "Locating the assistant
# turns"): which text renders the assistant header, and whether add_generation_prompt appends anything
SHAPES = {
    "generation prompt = header, also rendered by the message (ChatML)":
        "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}" + _CALLS
        + "<|im_end|>\n{% else %}" + _OTHER + "\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "empty generation prompt, the message renders its own marker":
        "{% for m in messages %}{% if m.role == 'assistant' %}Assistant: {{ m.content or '' }}" + _CALLS
        + "<|im_end|>{% else %}" + _OTHER + "{% endif %}{% endfor %}",
    "empty generation prompt, the user or tool turn before renders the header":
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content or '' }}" + _CALLS + "<|im_end|>"
        "{% else %}" + _OTHER + "{% if m.role != 'system' %}<|im_start|>assistant\n{% endif %}{% endif %}"
        "{% endfor %}",
    "generation prompt = header, also rendered by the message, no end of turn (EOS appended)":
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content or '' }}" + _CALLS + "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
}
_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
TOOL_CONVERSATIONS = {
    "plain": ([{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"},
               {"role": "assistant", "content": "Bye"}],
              ["Hello", "Bye"]),
    "tool calls": ([{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                    {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                    {"role": "tool", "tool_call_id": "c1", "content": "2"},
                    {"role": "assistant", "content": "Let me see", "tool_calls": [_CALL]},
                    {"role": "tool", "tool_call_id": "c1", "content": "2"},
                    {"role": "assistant", "content": "Bye"}],
                   ['<call>f({"x": 1})</call>', 'Let me see<call>f({"x": 1})</call>', "Bye"]),
}


def _trained_runs(tok, tokens, targets):
    """The decoded runs of consecutive trained tokens."""
    runs, run = [], []
    for t, g in zip(tokens, targets):
        if g != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("conversation", list(TOOL_CONVERSATIONS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_turn_spans_mask_the_assistant_header_with_and_without_tool_calls(monkeypatch, qwen, shape, conversation):
    """Every assistant turn trains its content (tool calls included) and end of turn, never the header or marker
    before it, whichever text renders that header; the per-turn path (tool calls) and the marker fast path (plain
    turns) give the same spans. Before: with an empty generation prompt and a marker rendered by the message, the
    per-turn path trained the marker of every turn of a tool-call conversation."""
    import packsft.prompt_formats.chat_template as pf

    messages, contents = TOOL_CONVERSATIONS[conversation]
    fmt = get_prompt_format("chat-template", qwen, chat_template=SHAPES[shape])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = tokenize_conversation(messages, Tokenization.of(qwen, fmt), tools)
    eos = "<|im_end|>" if fmt.append_eos else ""  # appended to each trained turn, not rendered
    assert qwen.decode(got[0]).replace(eos, "") == qwen.apply_chat_template(
        pf._template_messages(messages), tools=tools, chat_template=SHAPES[shape], tokenize=False)
    assert _trained_runs(qwen, *got) == [c + "<|im_end|>" for c in contents]  # (<|im_end|> is also Qwen's EOS)
    monkeypatch.setattr(pf, "_marked_spans", lambda *a, **k: None)  # every turn located by the per-turn path
    assert tokenize_conversation(messages, Tokenization.of(qwen, fmt), tools) == got

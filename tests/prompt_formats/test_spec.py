"""The tokenization contract: a spec binds the format get_prompt_format binds, takes the options a loader leaves
open from the sidecar, is built once by the packer's config, and a mixture's datasets share one tokenizer."""

import dataclasses
from pathlib import Path

import pytest

from packsft.packing.config import PackConfig
from packsft.prompt_formats import Tokenization, TokenizationSpec, get_prompt_format, spec
from packsft.tokenizer import load_tokenizer, tokenizer_fingerprint

TOK = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir(TOK))


def test_a_spec_binds_what_get_prompt_format_binds(tok, tokenizer_dir):
    s = TokenizationSpec(str(tokenizer_dir(TOK)), "chat-template", chat_template_kwargs={"x": 1}, train_on="last",
                         append_eos=False)
    assert s.bind(tok) == get_prompt_format("chat-template", tok, chat_template_kwargs={"x": 1}, train_on="last",
                                            append_eos=False)
    assert TokenizationSpec("t", "passthrough", "<|im_start|>").bind(tok) == get_prompt_format(
        "passthrough", tok, pad_token="<|im_start|>")
    with pytest.raises(ValueError, match="--train-on and --append-eos need prompt format chat-template"):
        TokenizationSpec("t", "identity", train_on="last").bind(tok)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train_on = "all"


def test_resolve_loads_the_tokenizer_once_and_takes_its_fingerprint_once(tok, tokenizer_dir, monkeypatch):
    loaded, taken = [], []
    monkeypatch.setattr(spec, "load_tokenizer", lambda p: loaded.append(p) or tok)
    monkeypatch.setattr(spec, "tokenizer_fingerprint", lambda t: taken.append(t) or tokenizer_fingerprint(t))
    t = TokenizationSpec(str(tokenizer_dir(TOK))).resolve()
    assert isinstance(t, Tokenization) and t.tokenizer is tok and t.fmt == t.spec.bind(tok)
    assert t.fingerprint == t.fingerprint == tokenizer_fingerprint(tok)
    assert loaded == [str(tokenizer_dir(TOK))] and len(taken) == 1
    assert TokenizationSpec("unused").resolve(tok).tokenizer is tok and len(loaded) == 1


def test_with_packed_takes_the_options_left_open_from_the_sidecar_of_the_same_format():
    packed = {"name": "chat-template", "train_on": "last", "chat_template_kwargs": {"a": 1}, "append_eos": True}
    s = TokenizationSpec("t", "default").with_packed(packed)
    assert (s.train_on, s.chat_template_kwargs, s.append_eos) == ("last", {"a": 1}, True)
    given = TokenizationSpec("t", train_on="all", chat_template_kwargs={}, append_eos=False).with_packed(packed)
    assert (given.train_on, given.chat_template_kwargs, given.append_eos) == ("all", {}, False)
    other = TokenizationSpec("t", "passthrough").with_packed(packed)
    assert (other.train_on, other.chat_template_kwargs, other.append_eos) == ("all", None, None)
    assert TokenizationSpec("t").with_packed(None).train_on == "all"


def test_the_pack_config_holds_one_spec():
    cfg = PackConfig(inputs=["a"], output="o", tokenizer="t", max_seq_len=8, prompt_format="passthrough",
                     pad_token="<p>", chat_template_kwargs={"k": 1}, train_on="last", append_eos=True,
                     allow_non_megatron=True)
    assert cfg.tokenization == TokenizationSpec("t", "passthrough", "<p>", None, {"k": 1}, "last", True)


def test_a_mixture_loads_its_tokenizer_once(tmp_path, tokenizer_dir, monkeypatch):
    from packsft.data import dataset as dataset_module
    from packsft.packing.cli import main
    from packsft.train.config import load_config
    from packsft.train.data import build_datasets

    src = tmp_path / "in.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 4)
    outs = [tmp_path / f"{name}.jsonl.packed" for name in "ab"]
    for out in outs:
        assert main(["--input", str(src), "--output", str(out), "--tokenizer", str(tokenizer_dir(TOK)),
                     "--max-seq-length", "64", "--no-progress", "--histogram", ""]) == 0
    loaded, real = [], dataset_module.load_tokenizer
    monkeypatch.setattr(dataset_module, "load_tokenizer", lambda p: loaded.append(p) or real(p))
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    sources = ", ".join(f"{{name: {n}, path: '{o}', weight: 1}}" for n, o in zip("ab", outs))
    overrides = [f"data.train=[{sources}]", f"data.validation=[{{name: v, path: '{outs[0]}'}}]", "data.train_path=null",
                 f"data.tokenizer={tokenizer_dir(TOK)}", "data.max_seq_len=64", "data.split_validation_size=0",
                 "validation.val_period=0", "validation.val_at_end=false"]
    train, validation = build_datasets(load_config(tiny, overrides))
    assert len(loaded) == 1 and len(train.datasets) == 2 and list(validation) == ["v"]
    assert len({id(d.tokenizer) for d in [*train.datasets, *validation.values()]}) == 1

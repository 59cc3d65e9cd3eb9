"""Sidecar: atomic write, read errors, and the field-by-field refusal message."""

import dataclasses
import json
import shlex

import pytest

from packsft.data.repack import REPACK_OPTIONS, repack_hint
from packsft.prompt_formats import PromptFormat
from packsft.sidecar import (
    CHECKED_FIELDS,
    SidecarError,
    check_sidecar,
    loader_expectation,
    packing_efficiency,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)

FMT = PromptFormat(name="nemotron-h-aligned", pad_token="<SPECIAL_233>", pad_token_id=233)


def meta(**overrides):
    m = {"tokenizer_fingerprint": "abc", "prompt_format": FMT.spec(), "max_seq_len": 4096, "context_parallel_size": 2,
         "algorithm": "next-fit", "seed": 0, "counts": {"rows": 3}, "efficiency": 0.9}
    m.update(overrides)
    return m


@pytest.mark.parametrize("counts", [None, {"rows": 1}, {"real_tokens": "x", "padding_tokens": 1},
                                    {"real_tokens": -1, "padding_tokens": 1}, {"real_tokens": 1.5, "padding_tokens": 0},
                                    {"real_tokens": True, "padding_tokens": 0}, [1, 2]])
def test_packing_efficiency_of_edited_counts_is_unknown(counts):
    """A sidecar's counts edited by hand: the trainer's summary raised KeyError/TypeError (exit 1)."""
    assert packing_efficiency({"counts": counts}) is None
    assert packing_efficiency({"counts": {"real_tokens": 3, "padding_tokens": 1}}) == 0.75
    assert packing_efficiency({"counts": {"real_tokens": 3, "padding_tokens": 1}},      # a mixture's files together
                              {"counts": {"real_tokens": 5, "padding_tokens": 3}}) == 8 / 12


def test_sidecar_path():
    assert sidecar_path("d/x.jsonl.packed").as_posix() == "d/x.jsonl.packed.meta.json"
    assert sidecar_path("d/x.jsonl.packed.meta.json").as_posix() == "d/x.jsonl.packed.meta.json"


def test_write_then_read_round_trips_and_leaves_no_temporary_file(tmp_path):
    packed = tmp_path / "x.jsonl.packed"
    written = write_sidecar(packed, meta())
    assert written == tmp_path / "x.jsonl.packed.meta.json"
    assert read_sidecar(packed) == {"format_version": 2, **meta()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl.packed.meta.json"]


def test_failed_write_keeps_the_old_sidecar(tmp_path):
    packed = tmp_path / "x.jsonl.packed"
    write_sidecar(packed, meta())
    with pytest.raises(TypeError):
        write_sidecar(packed, meta(seed=object()))
    assert read_sidecar(packed)["seed"] == 0 and len(list(tmp_path.iterdir())) == 1


def test_missing_sidecar_reads_as_none(tmp_path):
    assert read_sidecar(tmp_path / "x.jsonl.packed") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "x.jsonl.packed.meta.json: a JSON array, not an object"),
        (json.dumps({**meta(), "format_version": 3}), "format_version 3 is not supported"),
        (json.dumps({"format_version": 2, **meta(max_seq_len=None) | {"prompt_format": {"name": "x"}}}),
         "missing field.*prompt_format.pad_token"),
        # inspect_packed took these as its defaults: a TypeError traceback, or an error naming no file
        (json.dumps({"format_version": 2, **meta(), "max_seq_len": "256"}),
         r"x.jsonl.packed.meta.json: max_seq_len is \"256\", not an integer >= 1"),
        (json.dumps({"format_version": 2, **meta(), "context_parallel_size": 0}),
         "context_parallel_size is 0, not an integer >= 1"),
    ],
)
def test_unreadable_sidecars_are_refused(tmp_path, text, message):
    (tmp_path / "x.jsonl.packed.meta.json").write_text(text)
    with pytest.raises(SidecarError, match=message):
        read_sidecar(tmp_path / "x.jsonl.packed")


def test_matching_sidecar_passes():
    check_sidecar(meta(), loader_expectation("abc", FMT, 4096, 2), "x.jsonl.packed", "hint")


@pytest.mark.parametrize("field", CHECKED_FIELDS)
def test_every_checked_field_is_compared_and_named(field):
    expected = loader_expectation("abc", FMT, 4096, 2)
    changed = json.loads(json.dumps(expected))
    *parents, last = field.split(".")
    target = changed
    for key in parents:
        target = target[key]
    target[last] = "other"
    with pytest.raises(SidecarError) as err:
        check_sidecar(meta(), changed, "x.jsonl.packed", "python pack ...")
    text = str(err.value)
    assert f"  {field}: packed for " in text and "loader has 'other'" in text
    assert sum(f"  {f}: " in text for f in CHECKED_FIELDS) == 1
    assert text.endswith("Re-pack it into a new file (then point the config at it) for this configuration:\n"
                         "  python pack ...")


def test_repack_hint_gives_the_loader_configuration():
    hint = repack_hint("out/x.jsonl.packed", {"inputs": ["a.jsonl", "b.jsonl"], "algorithm": "next-fit", "seed": 7},
                       FMT, "tok/dir", 8192, 4)
    command, note = hint.split("\n")
    # a new file: a run that still uses the old one (packed for CP 1, say) is not disturbed
    assert command == ("python tools/pack_megatron_sft_jsonl.py --input a.jsonl b.jsonl "
                       "--output out/x.L8192-cp4.jsonl.packed --tokenizer tok/dir --prompt-format nemotron-h-aligned "
                       "--max-seq-length 8192 --context-parallel-size 4 --pad-token '<SPECIAL_233>' "
                       "--algorithm next-fit --seed 7")
    assert note.startswith("  (no report of this packing run beside it (x.jsonl.packed.report.json): add the "
                           "original run's --oversize")
    assert repack_hint("x", {}, FMT, "t", 8, 1).startswith("python tools/pack_megatron_sft_jsonl.py --input "
                                                           "<your input .jsonl> --output x.L8-cp1.jsonl.packed ")


def _options(cfg):
    """The PackConfig fields a re-pack must repeat: all but the loader's own, the paths and the speed options."""
    skip = {"output", "report", "tokenizer", "max_seq_len", "context_parallel_size", "prompt_format", "pad_token",
            "chat_template", "chat_template_kwargs", "train_on", "append_eos", "progress", "num_workers", "engine",
            "ray_address", "shard_bytes"}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}


def test_repack_hint_repeats_every_packing_option_of_the_report(tmp_path):
    from packsft.packing.cli import parse_args
    from packsft.packing.config import PackConfig

    packed = tmp_path / "x.jsonl.packed"
    cfg = PackConfig(inputs=["a b.jsonl", "c.jsonl"], output=str(packed), tokenizer="tok", max_seq_len=64,
                     split="train", record_format="input-output", input_key="q", output_key="a",
                     default_system_prompt="Be 'brief'.", oversize="drop", max_conversation_bytes=1000,
                     allow_non_megatron=True, strict=True, shuffle_rows=True, seed=7, algorithm="next-fit",
                     token_cache=False, report=str(tmp_path / "x.jsonl.packed.report.json"), histogram="",
                     sequence_parallel_size=2)
    rows_file = {"size": 10, "blake2b": "ab"}
    report = {"settings": dataclasses.asdict(cfg), "rows_file": rows_file}
    (tmp_path / "x.jsonl.packed.report.json").write_text(json.dumps(report))
    fields = {"inputs": cfg.inputs, "algorithm": "next-fit", "seed": 7, "rows_file": rows_file}
    hint = repack_hint(packed, meta(**fields), FMT, "tok", 128, 2)
    again = parse_args(shlex.split(hint)[2:])
    assert (again.max_seq_len, again.context_parallel_size, again.pad_token) == (128, 2, "<SPECIAL_233>")
    assert _options(again) == _options(cfg), hint
    defaults = PackConfig(inputs=["a.jsonl"], output=str(packed), tokenizer="tok", max_seq_len=64)
    assert {f: d for f, _, d in REPACK_OPTIONS} == {f: getattr(defaults, f) for f, _, _ in REPACK_OPTIONS}
    (tmp_path / "x.jsonl.packed.report.json").write_text(json.dumps({**report, "rows_file": {"size": 11}}))
    other_run = repack_hint(packed, meta(**fields), FMT, "tok", 128, 2)   # a report of another run is not read
    assert "--oversize drop" not in other_run and "(no report of this packing run beside it" in other_run
    cached = repack_hint(packed, meta(**fields, token_cache={"tokens": {"size": 8}}), FMT, "tok", 128, 2)
    assert "--no-token-cache" not in cached.splitlines()[0]        # the sidecar records a cache: it was on
    # the inputs were relative to where the packer ran (the report's working_dir): the command works from anywhere
    moved = {**report, "working_dir": "/data/proj",
             "settings": {**report["settings"], "inputs": ["a b.jsonl", "/c.jsonl"]}}
    (tmp_path / "x.jsonl.packed.report.json").write_text(json.dumps(moved))
    anywhere = parse_args(shlex.split(repack_hint(packed, meta(**fields), FMT, "tok", 128, 2))[2:])
    assert anywhere.inputs == ["/data/proj/a b.jsonl", "/c.jsonl"]


def test_trainer_refusal_repeats_oversize_drop(tmp_path, tokenizer_dir):
    """A file packed with --oversize drop, opened at another max_seq_len: the re-pack command keeps the policy."""
    from packsft.data.dataset import PackedSFTDataset
    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    src = tmp_path / "in.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    long = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    src.write_text("\n".join(json.dumps({"messages": m}) for m in (chat, long)) + "\n")
    packed = tmp_path / "rows.jsonl.packed"
    tok = tokenizer_dir("smollm2-135m-instruct")
    run_pack(PackConfig(inputs=[str(src)], output=str(packed), tokenizer=str(tok), max_seq_len=64,
                        oversize="drop", histogram="", progress=False))
    with pytest.raises(SidecarError, match="max_seq_len: packed for 64, loader has 128") as err:
        PackedSFTDataset(packed, str(tok), "chat-template", 128)
    command = str(err.value).split("Re-pack it into a new file (then point the config at it) for this "
                                   "configuration:\n  ")[1]
    assert "\n" not in command and " --oversize drop" in command and " --max-seq-length 128" in command
    assert f" --output {tmp_path / 'rows.L128-cp1.jsonl.packed'} " in command


def test_version_1_sidecars_read_with_the_defaults_version_1_packed(tmp_path):
    """A format_version 1 sidecar has no train_on/chat_template_kwargs/append_eos: all, {} and false."""
    v1_spec = {k: v for k, v in FMT.spec().items() if k not in ("train_on", "chat_template_kwargs", "append_eos")}
    (tmp_path / "x.jsonl.packed.meta.json").write_text(json.dumps({**meta(), "format_version": 1,
                                                                   "prompt_format": v1_spec}))
    read = read_sidecar(tmp_path / "x.jsonl.packed")
    assert read["prompt_format"] == FMT.spec()
    check_sidecar(read, loader_expectation("abc", FMT, 4096, 2), tmp_path / "x.jsonl.packed", "hint")
    last = PromptFormat(name="chat-template", pad_token="<p>", pad_token_id=1, chat_template="t", train_on="last")
    with pytest.raises(SidecarError, match="prompt_format.train_on: packed for 'all', loader has 'last'"):
        check_sidecar(read, loader_expectation("abc", last, 4096, 2), tmp_path / "x.jsonl.packed", "hint")

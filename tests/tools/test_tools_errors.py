"""Every tool in tools/ answers a user error with one ``error: ...`` line and exit status 2, not a traceback."""

import contextlib
import importlib.util
import io
import json
import subprocess
import sys

import pytest
from distributed_helpers import tool_forked
from test_loop import REPO, packed, write_config  # noqa: F401 - fixture


def run_tool(*args, cwd=None):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    return proc.returncode, proc.stderr


def train_tool(*args):
    """``tools/train.py args``'s ``(exit status, stderr)`` as :func:`run_tool` returns them: its ``main`` in a fork of
    the tests' fork server (:func:`distributed_helpers.tool_forked`: torch and megatron-core are imported once)."""
    proc = tool_forked("train", *args, check=False)
    return proc.returncode, proc.stderr


def call_tool(path, *args):
    """The tool's ``main(argv)`` in this process (its heavy imports are paid once per test process): ``(exit status,
    stderr)``, as :func:`run_tool` returns them. An exception the tool lets escape fails the test."""
    spec = importlib.util.spec_from_file_location(f"tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = module.main([str(a) for a in args])
        except SystemExit as exit_:      # argparse
            rc = exit_.code
    return rc, err.getvalue()


def assert_user_error(rc, stderr, message):
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], stderr[-3000:]


TOOLS = REPO / "tools"


@pytest.mark.parametrize(("args", "message"), [
    (["import", "--hf", "{tmp}/missing", "--out", "{tmp}/out"], "--hf {tmp}/missing does not exist"),
    (["import", "--hf", "{tmp}/gpt2", "--out", "{tmp}/out"], "unsupported model_type 'gpt2'"),
    (["export", "--megatron", "{tmp}", "--out", "{tmp}/out"],
     "{tmp} has no model_config.json: not a packsft checkpoint folder"),
    (["export", "--megatron", "{tmp}", "--config", "{tmp}/c.yaml", "--out", "{tmp}/out"],
     "{tmp}/c.yaml: unknown ModelConfig fields ['num_layer']"),
    (["import", "--hf", "{tmp}/gpt2", "--out", "{tmp}/c.yaml"],   # a file: it was replaced by the folder
     "--out {tmp}/c.yaml is a file, not a folder"),
    (["export", "--megatron", "{tmp}", "--out", "{tmp}/c.yaml"], "--out {tmp}/c.yaml is a file, not a folder"),
], ids=["missing", "unsupported", "not_a_checkpoint", "unknown_field", "import_out_file", "export_out_file"])
def test_convert_checkpoint(tmp_path, args, message):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
                                                               "n_head": 4, "vocab_size": 50257}))
    import torch
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, tmp_path / "gpt2" / "model.safetensors")
    (tmp_path / "c.yaml").write_text("model: {num_layer: 2}\n")         # a typo of num_layers
    fill = [a.format(tmp=tmp_path) for a in args]
    assert_user_error(*call_tool(TOOLS / "convert_checkpoint.py", *fill), message.format(tmp=tmp_path))
    assert (tmp_path / "c.yaml").read_text() == "model: {num_layer: 2}\n"  # never replaced


def test_convert_checkpoint_parallel_sizes_must_be_positive(tmp_path):
    for flag, value in (("--tensor-model-parallel-size", "0"), ("--pipeline-model-parallel-size", "-1")):
        rc, err = call_tool(TOOLS / "convert_checkpoint.py", flag, value, "import", "--hf", tmp_path, "--out",
                           tmp_path / "out")
        assert rc == 2 and f"argument {flag}: must be >= 1, got {value}" in err, err
    rc, err = call_tool(TOOLS / "convert_checkpoint.py", "import", "--hf", tmp_path, "--out", tmp_path / "out",
                       "--max-seq-len", "-5")      # was accepted
    assert rc == 2 and "argument --max-seq-len: must be >= 1, got -5" in err, err


def test_convert_checkpoint_export_refuses_a_tokenizer_larger_than_the_model(tmp_path, tokenizer_dir):
    from dataclasses import asdict

    from packsft.model.config import ModelConfig
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=49152, max_position_embeddings=128)
    (tmp_path / "model_config.json").write_text(json.dumps(asdict(cfg)))     # refused before any weight is read
    assert_user_error(*call_tool(TOOLS / "convert_checkpoint.py", "export", "--megatron", tmp_path, "--out",
                                tmp_path / "out", "--tokenizer", tokenizer_dir("qwen2.5")),
                      f"model.vocab_size (49152) is smaller than the tokenizer {tokenizer_dir('qwen2.5')} "
                      "(151665 tokens)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("length", [["--max-seq-len", "256"], ["--max-seq-length", "256"], []],
                         ids=["length", "packer_spelling", "no_length"])
def test_inspect_packed(tmp_path, length):
    assert_user_error(*call_tool(TOOLS / "inspect_packed.py", "--packed", tmp_path / "x.packed", "--tokenizer",
                                tmp_path, "--prompt-format", "chat-template", *length),
                      "packed file not found")
    assert_user_error(*call_tool(TOOLS / "inspect_packed.py", "--packed", tmp_path, "--tokenizer", tmp_path,
                                "--prompt-format", "chat-template", *length),
                      f"packed file {tmp_path} is a folder, not a file")
    sidecar = tmp_path / "x.jsonl.packed.meta.json"
    sidecar.write_text('{"max_seq_len": 256}')
    assert_user_error(*call_tool(TOOLS / "inspect_packed.py", "--packed", sidecar, "--tokenizer", tmp_path,
                                "--prompt-format", "chat-template", *length),  # it said: does not match its sidecar
                      f"{sidecar} is a sidecar: give its packed rows file, {tmp_path / 'x.jsonl.packed'}")


def test_plan_memory(tmp_path):
    assert_user_error(*run_tool(TOOLS / "plan_memory.py", "--config", tmp_path / "missing.yaml"),
                      "config file not found")
    (tmp_path / "bad.yaml").write_text("a: [\n")  # before: a yaml ParserError traceback
    assert_user_error(*call_tool(TOOLS / "plan_memory.py", "--config", tmp_path / "bad.yaml"),
                      f"invalid config {tmp_path / 'bad.yaml'}: not valid YAML: while parsing a flow node")
    assert_user_error(*call_tool(TOOLS / "plan_memory.py", "--config", REPO / "configs" / "llama3_8b_multigpu.yaml",
                                "--sweep", "--world-size", "16", "--seq-lens", "8192", "999999999999999"),
                      "--seq-lens must be token counts from 1 to 16,777,216")
    assert_user_error(*call_tool(TOOLS / "plan_memory.py", "--config", tmp_path),  # was "not found"
                      f"config file {tmp_path} is a folder, not a file")
    rc, err = call_tool(TOOLS / "plan_memory.py", "--config", REPO / "configs" / "llama3_8b_multigpu.yaml",
                       "--seq-lens", "8192")  # without --sweep it was ignored
    assert rc == 2 and "error: --seq-lens is for --sweep" in err, err[-2000:]


def test_make_megatron_sft_fixtures_needs_a_megatron_lm_folder(tmp_path, tokenizer_dir):
    for folder in (tmp_path / "nope", tmp_path):  # before: FileNotFoundError tracebacks
        assert_user_error(*call_tool(TOOLS / "make_megatron_sft_fixtures.py", "--megatron-lm", folder, "--tokenizer",
                                    tokenizer_dir("nemotron-h-layout-tekken"), "--out", tmp_path / "f.json"),
                          f"--megatron-lm {folder} is not a Megatron-LM source folder: it has no ")


def test_inspect_packed_sizes_must_be_positive(tmp_path):
    for flag, name in (("--max-seq-len", "--max-seq-len/--max-seq-length"),  # 0 was taken as "not given"
                       ("--context-parallel-size", "--context-parallel-size")):
        rc, err = call_tool(TOOLS / "inspect_packed.py", "--packed", tmp_path / "x.jsonl.packed", "--tokenizer",
                           tmp_path, "--prompt-format", "chat-template", flag, "0")
        assert rc == 2 and f"argument {name}: must be >= 1, got 0" in err, err


def test_pack(tmp_path):
    assert_user_error(*run_tool(TOOLS / "pack_megatron_sft_jsonl.py", "--input", tmp_path / "missing.jsonl",
                                "--output", tmp_path / "x.packed", "--tokenizer", tmp_path, "--max-seq-length", "256"),
                      "no such file")


def test_pack_output_in_a_folder_that_cannot_be_written(tmp_path, tokenizer_dir):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rows = tmp_path / "ok" / "rows.jsonl.packed"
    for flags, flag, bad in ((["--output", blocker / "rows.jsonl.packed"], "--output", blocker / "rows.jsonl.packed"),
                             (["--output", rows, "--report", blocker / "r.json"], "--report", blocker / "r.json")):
        rc, err = run_tool(TOOLS / "pack_megatron_sft_jsonl.py", "--input", src, *flags, "--max-seq-length", "256",
                           "--tokenizer", tokenizer_dir("smollm2-135m-instruct"), "--no-progress")
        assert_user_error(rc, err, f"{flag} {bad}: its folder {bad.parent} is not writable ({blocker} is a file, "
                                   "not a folder)")
    assert not rows.exists()


def test_pack_unloadable_tokenizer_files_are_named(tmp_path, tokenizer_dir):
    """A config file given as the tokenizer, or a folder with a corrupt or truncated file: one error line naming
    the path (before: a traceback, or the JSON error alone)."""
    import shutil

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    corrupt, truncated = tmp_path / "corrupt", tmp_path / "truncated"
    for folder in (corrupt, truncated):
        shutil.copytree(tokenizer_dir("smollm2-135m-instruct"), folder)
    (corrupt / "tokenizer_config.json").write_text("{bad")
    with open(truncated / "tokenizer.json", "r+b") as f:
        f.truncate(1000)
    config = tokenizer_dir("smollm2-135m-instruct") / "tokenizer_config.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    for tok, what in ((config, "as a tokenizer.json file: Exception: "), (corrupt, "as a tokenizer folder"),
                      (truncated, "as a tokenizer folder"), (empty, "as a tokenizer folder")):
        rc, err = run_tool(TOOLS / "pack_megatron_sft_jsonl.py", "--input", src, "--output", tmp_path / "x.packed",
                           "--tokenizer", tok, "--max-seq-length", "256", "--no-progress")
        assert_user_error(rc, err, f"cannot load the tokenizer at {tok} {what}")
        assert err.rstrip().splitlines()[-1].startswith("error: "), err  # one line (transformers' has several)


def test_pack_parallel_sizes_must_be_positive(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    for flag in ("--tensor-model-parallel-size", "--context-parallel-size"):
        rc, err = run_tool(TOOLS / "pack_megatron_sft_jsonl.py", "--input", src, "--output", tmp_path / "x.packed",
                           "--tokenizer", tmp_path, "--max-seq-length", "256", flag, "0")
        assert rc == 2 and f"argument {flag}: must be >= 1, got 0" in err, err


def test_train_missing_config(tmp_path):
    assert_user_error(*train_tool("--config", tmp_path / "missing.yaml"), "config file not found")


def test_train_resume_none_over_an_earlier_run(tmp_path, packed):  # noqa: F811
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    cfg = write_config(tmp_path / "c.yaml", packed, out)
    assert_user_error(*train_tool("--config", cfg, "checkpoint.resume=none"),
                      "checkpoint.resume=none but the run folder holds an earlier run")
    assert (out / "metrics.jsonl").read_text() == '{"kind": "train", "step": 1}\n'      # nothing appended


def test_train_te_backend_without_transformer_engine(tmp_path, packed):  # noqa: F811
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("TransformerEngine is installed")
    except ImportError:
        pass
    cfg = write_config(tmp_path / "c.yaml", packed, tmp_path / "run")
    assert_user_error(*train_tool("--config", cfg, "model.attention_backend=te"),
                      "model.attention_backend='te' needs TransformerEngine")


def test_convert_checkpoint_lora_base_on_a_whole_model_is_refused(tmp_path):
    """``--lora-base`` on a checkpoint that holds its whole model was silently ignored."""
    from dataclasses import asdict

    from packsft.model.config import ModelConfig
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128)
    (tmp_path / "model_config.json").write_text(json.dumps(asdict(cfg)))
    assert_user_error(*call_tool(TOOLS / "convert_checkpoint.py", "export", "--megatron", tmp_path, "--out",
                                tmp_path / "out", "--lora-base", tmp_path / "base"),
                      f"--lora-base is for the checkpoint of a LoRA run started from an imported base (it holds only "
                      f"the adapters), and {tmp_path} is none (its train_state.json records no LoRA base)")


@pytest.mark.parametrize("num_workers", [0, 1])
def test_train_a_row_that_does_not_tokenize_is_an_error_line(tmp_path, packed, num_workers):  # noqa: F811
    """A file without sidecar is checked for structure at open; a row that fails to tokenize surfaced at its step as
    a traceback, exit 1 (with loader workers torch rebuilt it as a RuntimeError holding the worker's traceback)."""
    bad = tmp_path / "bad.jsonl.packed"
    row = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "a"},
                        {"role": "assistant", "content": ""}]}
    bad.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    cfg = write_config(tmp_path / "c.yaml", packed, tmp_path / "run", data={"train_path": str(bad)},
                       loader={"num_workers": num_workers})
    rc, stderr = train_tool("--config", cfg, "train.train_steps=2", "scheduler.warmup_steps=1")
    assert_user_error(rc, stderr, "conversation 0: messages[2]: empty assistant turn")
    assert f"error: {bad}:" in stderr          # the file and its line (the sampler's first row: 1 or 2)


def test_launch_reports_a_failed_trainer_in_one_line(tmp_path):
    """packsft.train.launch passes a trainer's error exit on without torchrun's ChildFailedError report."""
    rc, stderr = run_tool("-m", "packsft.train.launch", "--standalone", "--nproc-per-node", "1", TOOLS / "train.py",
                          "--config", tmp_path / "missing.yaml", cwd=REPO)
    assert_user_error(rc, stderr, "missing.yaml")
    assert "ChildFailedError" not in stderr and "packsft.train.launch: trainer rank 0 exited with 2" in stderr, stderr


@pytest.mark.parametrize("tool", ["train", "inspect"])
def test_a_stray_publish_journal_beside_the_rows_is_an_error_line(tmp_path, packed, tool):  # noqa: F811
    """A reader meeting a journal it cannot finish names it in one line (was a traceback through the dataset)."""
    import shutil

    rows = tmp_path / "rows.jsonl.packed"
    for src in packed["few"].parent.glob(packed["few"].name + "*"):
        shutil.copy(src, tmp_path / src.name.replace(packed["few"].name, rows.name))
    journal = tmp_path / ".rows.jsonl.packed.publish.json"
    journal.write_text("{junk")
    if tool == "train":
        cfg = write_config(tmp_path / "c.yaml", packed, tmp_path / "run", data={"train_path": str(rows)})
        rc, stderr = train_tool("--config", cfg, "train.train_steps=2", "scheduler.warmup_steps=1")
    else:
        rc, stderr = run_tool(TOOLS / "inspect_packed.py", "--packed", rows, "--tokenizer", packed["tokenizer"],
                              "--prompt-format", "chat-template", "--row", "0")
    assert_user_error(rc, stderr, f"{journal}: not a packsft publish journal")

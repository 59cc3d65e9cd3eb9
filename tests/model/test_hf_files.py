"""The exported HF folder: usual permissions whatever the sources' modes, no stale quantization_config, the
tokenizer folder's generation_config.json."""

import json
import os
import shutil
import stat

import torch
from test_hf_io import hf_config

from packsft.model.hf_files import write_hf_checkpoint


def test_export_is_0755_0644_and_drops_quantization_config(tmp_path, tokenizer_dir):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir("smollm2-135m-instruct"), tok)
    for f in tok.iterdir():
        os.chmod(f, 0o600)                                   # e.g. extracted by a tool that keeps files private
    config = hf_config("llama")
    config.quantization_config = {"quant_method": "gguf"}  # what a GGUF source config carries
    umask = os.umask(0o022)
    try:
        out = write_hf_checkpoint({"w": torch.zeros(4)}, config, tmp_path / "hf", tokenizer_dir=tok)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert "tokenizer.json" in modes and set(modes.values()) == {0o644}, modes
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert config.quantization_config == {"quant_method": "gguf"}                 # the caller's config is untouched


def test_quantized_tensors_keep_quantization_config(tmp_path):
    config = hf_config("llama")
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    out = write_hf_checkpoint({"w": torch.zeros(4, dtype=torch.int8)}, config, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "bitsandbytes"


def test_tokenizer_folder_generation_config_is_kept(tmp_path, tokenizer_dir):
    tok = tmp_path / "tok"                                   # an original model folder: Qwen2.5-Instruct's file
    shutil.copytree(tokenizer_dir("qwen2.5"), tok)
    original = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tok / "generation_config.json").write_text(json.dumps(original))
    out = write_hf_checkpoint({"w": torch.zeros(4)}, hf_config("qwen2"), tmp_path / "hf", tokenizer_dir=tok)
    written = json.loads((out / "generation_config.json").read_text())
    assert {k: written.get(k) for k in original} == original
    derived = write_hf_checkpoint({"w": torch.zeros(4)}, hf_config("qwen2", eos_token_id=5), tmp_path / "hf2",
                                  tokenizer_dir=tokenizer_dir("qwen2.5"))
    assert json.loads((derived / "generation_config.json").read_text())["eos_token_id"] == 5


def test_export_out_holding_other_files_is_refused(tmp_path, tokenizer_dir):
    """export --out replaced a folder holding notes and subfolders whole (printed 'wrote', exit 0)."""
    import pytest
    from test_convert_checkpoint_errors import _convert_tool

    from packsft.train.convert import refuse_foreign_out

    tool = _convert_tool()
    state = {"a": torch.zeros(4), "b": torch.zeros(4)}
    out = write_hf_checkpoint(state, hf_config("llama"), tmp_path / "hf",
                              tokenizer_dir=tokenizer_dir("smollm2-135m-instruct"), max_shard_bytes=16)
    assert (out / "model-00002-of-00002.safetensors").is_file() and (out / "tokenizer.json").is_file()
    (tmp_path / "empty").mkdir()
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")

    def check(folder, *extra):
        refuse_foreign_out(tool.parse_args(["export", "--megatron", str(tmp_path / "mg"), "--out", str(folder),
                                                 *extra]))

    check(out, "--lora-adapter", str(tmp_path / "adapter"))     # a previous export and adapter are replaced
    check(tmp_path / "empty")
    check(tmp_path / "new")
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    with pytest.raises(ValueError, match=f"--out {out} holds files that are not a previous export: notes.txt, sub/; "
                                         "the folder is replaced as a whole"):
        check(out)
    (tmp_path / "adapter" / "README.md").write_text("mine")
    with pytest.raises(ValueError, match="--lora-adapter .*adapter holds files that are not a previous PEFT adapter "
                                         "export: README.md;"):
        check(tmp_path / "empty", "--lora-adapter", str(tmp_path / "adapter"))

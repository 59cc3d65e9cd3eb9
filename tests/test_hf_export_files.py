"""The exported HF folder: usual permissions whatever the sources' modes, no stale quantization_config, the
tokenizer folder's generation_config.json."""

import json
import os
import shutil
import stat

import torch
from test_hf_convert import hf_config

from packsft.model.hf_io import write_hf_checkpoint


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

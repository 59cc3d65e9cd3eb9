"""The exported HF folder: usual permissions whatever the sources' modes, no stale quantization_config."""

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

"""A tokenizer or model folder whose config names its own code (``auto_map``) is refused, never run: transformers
otherwise asks on stdin whether to run it, and runs it on ``y``."""

import json
import shutil
import subprocess
import sys

import pytest
from test_loop import REPO

CODE = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


def _answer_yes(snippet: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", snippet], input="y\ny\n", capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={"OMP_NUM_THREADS": "1", "PATH": "", "PYTHONPATH": str(REPO)})


def test_a_tokenizer_with_its_own_code_is_refused(tmp_path, tokenizer_dir):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir("smollm2-135m-instruct"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(CODE + "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    proc = _answer_yes(f"from packsft.tokenizer import load_tokenizer\nload_tokenizer({str(folder)!r})")
    assert not (folder / "RAN").exists(), proc.stderr[-2000:]
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert f"cannot load the tokenizer at {folder}: its tokenizer_config.json needs the folder's own code" in \
        proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("reader", ["load_hf_config", "load_hf_checkpoint"])
def test_a_model_config_with_its_own_code_is_refused(tmp_path, reader):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "evil", "architectures": ["EvilForCausalLM"],
                                                    "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (folder / "evil.py").write_text(CODE + "from transformers import PretrainedConfig\n"
                                    "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    proc = _answer_yes(f"from packsft.model.hf_files import {reader}\n{reader}({str(folder)!r})")
    assert not (folder / "RAN").exists(), proc.stderr[-2000:]
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert f"{folder}: its config.json needs the checkpoint's own code (auto_map)" in proc.stderr, proc.stderr[-2000:]

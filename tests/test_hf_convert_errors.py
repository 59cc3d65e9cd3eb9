"""convert_checkpoint.py on broken or misused inputs: one ``error: ...`` line and exit 2, nothing destroyed."""

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tools_errors import TOOLS, assert_user_error, run_tool
from transformers import AutoModelForCausalLM, LlamaConfig

CONVERT = TOOLS / "convert_checkpoint.py"


def tiny_llama(path, **overrides):
    """A tiny untied Llama (head_dim 32 != 64 / 4) saved as a safetensors folder."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
                                tie_word_embeddings=False), **overrides})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def edit_tensors(path, edit):
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.pop("lm_head.weight"), "HF checkpoint has no tensor 'lm_head.weight'"),
    (lambda s: s.pop("model.layers.1.self_attn.q_proj.weight"),
     "HF checkpoint has no tensor 'model.layers.1.self_attn.q_proj.weight'"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     "HF tensor 'model.layers.0.self_attn.k_proj.weight' has shape (16, 64), but the config implies (64, 64)"),
    (lambda s: s.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}),
     "HF tensor 'model.layers.0.mlp.up_proj.weight' has shape (95, 64), but the config implies (96, 64)"),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)}),
     "tensor(s) that its config.json does not use, e.g. ['model.layers.2.mlp.up_proj.weight']"),
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}),
     "1 tensor(s) that its config.json does not use, e.g. ['model.layers.0.self_attn.q_proj.bias']"),
], ids=["missing_lm_head", "missing_q_proj", "k_proj_shape", "up_proj_shape", "third_layer", "llama_bias"])
def test_import_of_a_missing_or_misshapen_tensor_is_a_user_error(tmp_path, edit, message):
    hf = tiny_llama(tmp_path / "hf")
    edit_tensors(hf, edit)
    assert_user_error(*run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"), message)
    assert not (tmp_path / "out").exists()


def test_import_reads_a_checkpoint_with_rotary_buffers():
    """Older Llama checkpoints hold each layer's rotary inv_freq: a buffer computed from the config, not read."""
    from packsft.model.config import ModelConfig
    from packsft.model.hf_io import model_hf_names

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128)
    used = model_hf_names(cfg)
    assert used("model.layers.1.self_attn.rotary_emb.inv_freq") and used("lm_head.weight")
    assert used("model.rotary_emb.inv_freq")
    assert not used("model.layers.2.input_layernorm.weight") and not used("model.layers.0.self_attn.q_proj.bias")
    assert not used("model.layers.0.self_attn.q_norm.weight") and not used("model.embed_tokens.bias")
    qwen3 = model_hf_names(dataclasses.replace(cfg, qk_layernorm=True, add_qkv_bias=True))
    assert qwen3("model.layers.0.self_attn.q_norm.weight") and qwen3("model.layers.0.self_attn.v_proj.bias")


def test_import_of_a_truncated_safetensors_file_is_a_user_error(tmp_path):
    hf = tiny_llama(tmp_path / "hf")
    with open(hf / "model.safetensors", "r+b") as f:
        f.truncate(5000)
    assert_user_error(*run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"),
                      f"{hf / 'model.safetensors'}: not a readable safetensors file")


def test_export_of_an_unloadable_checkpoint_is_a_user_error(tmp_path):
    hf = tiny_llama(tmp_path / "hf")
    rc, stderr = run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    other = tiny_llama(tmp_path / "other", head_dim=16)                      # its attention is half as wide
    rc, stderr = run_tool(CONVERT, "import", "--hf", other, "--out", tmp_path / "mg_other")
    assert rc == 0, stderr[-3000:]
    # torch's checkpoint reader raises a CheckpointException (a BaseException) wrapping the shape mismatch
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                "--config", tmp_path / "mg_other" / "model_config.json"),
                      f"{tmp_path / 'mg'}: cannot load the checkpoint: CheckpointingException: Global shape mismatch")
    distcp = sorted((tmp_path / "mg").glob("*.distcp"))[-1]
    with open(distcp, "r+b") as f:
        f.truncate(1000)
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out"),
                      f"{tmp_path / 'mg'}: cannot load the checkpoint: EOFError")
    assert not (tmp_path / "out").exists()


def test_export_hf_config_that_is_missing_is_refused_and_a_folder_is_read(tmp_path):
    import json

    from transformers import MistralConfig
    hf = tmp_path / "mistral"
    MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, sliding_window=128,
                  bos_token_id=5, eos_token_id=6).save_pretrained(hf)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MistralConfig.from_pretrained(hf)).save_pretrained(hf)
    rc, stderr = run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    (tmp_path / "mg" / "hf_config.json").unlink()          # e.g. a trainer checkpoint: the config must be given
    missing = tmp_path / "typo" / "config.json"
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                "--hf-config", missing), f"--hf-config {missing}: {missing} not found")
    assert not (tmp_path / "out").exists()                  # was: a fresh LlamaConfig, bos 1 / eos 2, no window
    rc, stderr = run_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                          "--hf-config", hf)                # the original model's folder
    assert rc == 0, stderr[-3000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["bos_token_id"], config["eos_token_id"]) == (
        "mistral", 128, 5, 6)


def test_out_that_would_replace_an_input_is_refused(tmp_path, tokenizer_dir):
    hf = tiny_llama(tmp_path / "hf")
    before = sorted(p.name for p in hf.iterdir())
    assert_user_error(*run_tool(CONVERT, "import", "--hf", hf, "--out", hf),       # was: the model replaced
                      f"--out {hf} would replace --hf {hf}")
    assert_user_error(*run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path),  # a folder holding it
                      f"--out {tmp_path} would replace --hf {hf}")
    assert sorted(p.name for p in hf.iterdir()) == before
    tok = tmp_path / "tok"                                  # e.g. the original model's folder
    shutil.copytree(tokenizer_dir("smollm2-135m-instruct"), tok)
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", hf, "--out", tok, "--tokenizer", tok),
                      f"--out {tok} would replace --tokenizer {tok}")
    assert (tok / "tokenizer.json").is_file()
    run = tmp_path / "run"                                  # a LoRA adapter written over its own training run
    (run / "checkpoints" / "iter_0000006").mkdir(parents=True)
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", run / "checkpoints" / "iter_0000006",
                                "--out", tmp_path / "hf_out", "--lora-adapter", run),
                      f"--lora-adapter {run} would replace --megatron {run / 'checkpoints' / 'iter_0000006'}")
    assert_user_error(*run_tool(CONVERT, "export", "--megatron", hf, "--out", tmp_path / "o", "--lora-adapter",
                                tmp_path / "o" / "adapter"), f"--out {tmp_path / 'o'} would replace --lora-adapter")
    assert (run / "checkpoints" / "iter_0000006").is_dir()


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    hf = tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    edit_tensors(hf, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"] + 1}))
    # transformers keeps such an lm_head apart from the embedding; the import tied them (logits off by ~34)
    assert_user_error(*run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"),
                      "the checkpoint's lm_head.weight differs from model.embed_tokens.weight")
    edit_tensors(hf, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    rc, stderr = run_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out")     # an equal copy is fine
    assert rc == 0, stderr[-3000:]

"""convert_checkpoint.py on broken or misused inputs: one ``error: ...`` line and exit 2, nothing destroyed."""

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_tools_errors import TOOLS, assert_user_error, call_tool
from transformers import AutoModelForCausalLM, LlamaConfig

from packsft.model.hf_config import model_config_from_hf
from packsft.model.hf_files import check_hf_weight_files, load_hf_checkpoint, load_hf_config

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
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"), message)
    assert not (tmp_path / "out").exists()


def _llama_8b_config(path):
    """A folder with Llama-3-8B's config.json: building its model (32 GB in fp32) would be slow or killed."""
    LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192).save_pretrained(path)
    return path


def _truncated_copy(src, dst):
    data = src.read_bytes()
    dst.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize(("write", "message"), [
    (lambda f: f.write_bytes(bytes(range(256)) * 64), "not a readable safetensors file (Error while deserializing "
                                                      "header: header too large)"),
    (lambda f: f.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4a1b\nsize 16060522496\n"),
     "a Git LFS pointer, not the weights"),
    (lambda f: (save_file({"model.norm.weight": torch.ones(4096)}, f.parent / "whole"),
                _truncated_copy(f.parent / "whole", f)), "not a readable safetensors file"),
    (lambda f: save_file({"model.norm.weight": torch.ones(4096), "model.embed_tokens.weight": torch.zeros(8, 4096)},
                         f), "HF tensor 'model.embed_tokens.weight' has shape (8, 4096), but the config implies "
                             "(128256, 4096)"),
], ids=["junk", "lfs_pointer", "truncated", "wrong_shape"])
def test_import_of_a_bad_weight_file_is_named_before_the_model_is_built(tmp_path, monkeypatch, capsys, write,
                                                                        message):
    """Import read the weights after building the model: an 8B config's junk or Git LFS pointer model.safetensors
    was killed by the kernel (exit 137, no message) while the model was built."""
    hf = _llama_8b_config(tmp_path / "hf")
    write(hf / "model.safetensors")
    tool = _convert_tool()

    def build(cfg):
        raise AssertionError("the model was built before the weight files were checked")

    monkeypatch.setattr("packsft.train.convert.build_gpt_model", build)
    assert tool.main(["import", "--hf", str(hf), "--out", str(tmp_path / "out")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {hf / 'model.safetensors'}: ") and message in errors[0], \
        errors
    assert not (tmp_path / "out").exists()


def test_import_names_a_missing_tensor_from_the_headers(tmp_path):
    hf = _llama_8b_config(tmp_path / "hf")
    save_file({"model.norm.weight": torch.ones(4096)}, hf / "model.safetensors")
    cfg = model_config_from_hf(load_hf_config(hf))
    with pytest.raises(ValueError, match="hf: HF checkpoint has no tensor 'model.embed_tokens.weight' \\(and 289 "
                                         "more\\), which its config needs"):
        check_hf_weight_files(hf, cfg)


def test_an_out_that_cannot_be_written_is_named_before_any_work(tmp_path, capsys):
    """A read-only --out printed only the OS error about a temp folder, without naming --out."""
    (tmp_path / "mg").mkdir()
    (tmp_path / "file").write_text("")
    tool = _convert_tool()
    assert tool.main(["export", "--megatron", str(tmp_path / "mg"), "--out", str(tmp_path / "file" / "hf")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --out {tmp_path / 'file' / 'hf'}: its folder "
                                               f"{tmp_path / 'file'} is not writable ({tmp_path / 'file'} is a "
                                               "file, not a folder)")


def test_out_holding_other_files_is_refused_and_a_previous_import_is_replaced(tmp_path):
    """import/export --out replaced a folder of notes and subfolders whole, printed 'wrote' and exited 0."""
    hf = tiny_llama(tmp_path / "hf")
    out = tmp_path / "mg"
    for _ in range(2):                                       # the second replaces the first: a previous import
        rc, stderr = call_tool(CONVERT, "import", "--hf", hf, "--out", out)
        assert rc == 0, stderr[-3000:]
    imported = sorted(p.name for p in out.iterdir())
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", out),
                      f"--out {out} holds files that are not a previous import: notes.txt, sub/; the folder is "
                      "replaced as a whole")
    assert (out / "notes.txt").read_text() == "mine" and (out / "sub").is_dir()
    (out / "notes.txt").unlink()
    (out / "sub").rmdir()
    assert sorted(p.name for p in out.iterdir()) == imported
    other = tmp_path / "other"                               # an import is not an export
    shutil.copytree(out, other)
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", out, "--out", other),
                      f"--out {other} holds files that are not a previous export: .metadata, __0_0.distcp, ")
    assert sorted(p.name for p in other.iterdir()) == imported


def test_import_reads_a_checkpoint_with_rotary_buffers():
    """Older Llama checkpoints hold each layer's rotary inv_freq: a buffer computed from the config, not read."""
    from packsft.model.config import ModelConfig
    from packsft.model.hf_files import model_hf_names

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
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"),
                      f"{hf / 'model.safetensors'}: not a readable safetensors file")


def test_export_of_an_unloadable_checkpoint_is_a_user_error(tmp_path):
    hf = tiny_llama(tmp_path / "hf")
    rc, stderr = call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    other = tiny_llama(tmp_path / "other", head_dim=16)                      # its attention is half as wide
    rc, stderr = call_tool(CONVERT, "import", "--hf", other, "--out", tmp_path / "mg_other")
    assert rc == 0, stderr[-3000:]
    # another model's config: refused against the folder's own model_config.json before any weight is read
    # (before: torch's reader raised a CheckpointException wrapping the shape mismatch; a config whose shapes
    # matched exported another model silently)
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                "--config", tmp_path / "mg_other" / "model_config.json"),
                      f"differs from {tmp_path / 'mg' / 'model_config.json'}")
    # torch's checkpoint reader raises a CheckpointException (a BaseException) wrapping the shape mismatch
    wrong = tmp_path / "mg_wrong"
    shutil.copytree(tmp_path / "mg", wrong)
    shutil.copy(tmp_path / "mg_other" / "model_config.json", wrong / "model_config.json")
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", wrong, "--out", tmp_path / "out"),
                      f"{wrong}: cannot load the checkpoint: CheckpointingException: Global shape mismatch")
    distcp = sorted((tmp_path / "mg").glob("*.distcp"))[-1]
    with open(distcp, "r+b") as f:
        f.truncate(1000)
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out"),
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
    rc, stderr = call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    (tmp_path / "mg" / "hf_config.json").unlink()          # e.g. a trainer checkpoint: the config must be given
    missing = tmp_path / "typo" / "config.json"
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                "--hf-config", missing), f"--hf-config {missing}: {missing} not found")
    assert not (tmp_path / "out").exists()                  # was: a fresh LlamaConfig, bos 1 / eos 2, no window
    rc, stderr = call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                          "--hf-config", hf)                # the original model's folder
    assert rc == 0, stderr[-3000:]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["bos_token_id"], config["eos_token_id"]) == (
        "mistral", 128, 5, 6)


def test_out_that_would_replace_an_input_is_refused(tmp_path, tokenizer_dir):
    hf = tiny_llama(tmp_path / "hf")
    before = sorted(p.name for p in hf.iterdir())
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", hf),       # was: the model replaced
                      f"--out {hf} would replace --hf {hf}")
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path),  # a folder holding it
                      f"--out {tmp_path} would replace --hf {hf}")
    assert sorted(p.name for p in hf.iterdir()) == before
    tok = tmp_path / "tok"                                  # e.g. the original model's folder
    shutil.copytree(tokenizer_dir("smollm2-135m-instruct"), tok)
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", hf, "--out", tok, "--tokenizer", tok),
                      f"--out {tok} would replace --tokenizer {tok}")
    assert (tok / "tokenizer.json").is_file()
    run = tmp_path / "run"                                  # a LoRA adapter written over its own training run
    (run / "checkpoints" / "iter_0000006").mkdir(parents=True)
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", run / "checkpoints" / "iter_0000006",
                                "--out", tmp_path / "hf_out", "--lora-adapter", run),
                      f"--lora-adapter {run} would replace --megatron {run / 'checkpoints' / 'iter_0000006'}")
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", hf, "--out", tmp_path / "o", "--lora-adapter",
                                tmp_path / "o" / "adapter"), f"--out {tmp_path / 'o'} would replace --lora-adapter")
    assert (run / "checkpoints" / "iter_0000006").is_dir()


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path):
    hf = tiny_llama(tmp_path / "hf", tie_word_embeddings=True)
    edit_tensors(hf, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"] + 1}))
    # transformers keeps such an lm_head apart from the embedding; the import tied them (logits off by ~34)
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"),
                      "the checkpoint's lm_head.weight differs from model.embed_tokens.weight")
    edit_tensors(hf, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    rc, stderr = call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out")     # an equal copy is fine
    assert rc == 0, stderr[-3000:]


def test_import_of_a_non_floating_tensor_is_refused(tmp_path):
    """An int8 (quantized) or int64 tensor was cast to float on import: garbage weights, exit 0."""
    hf = tiny_llama(tmp_path / "hf")
    q = "model.layers.0.self_attn.q_proj.weight"
    edit_tensors(hf, lambda s: s.update({q: (s[q] * 100).to(torch.int8)}))
    assert_user_error(*call_tool(CONVERT, "import", "--hf", hf, "--out", tmp_path / "out"),
                      f"{hf / 'model.safetensors'}: tensor '{q}' has dtype I8, not floating point; packsft imports "
                      "unquantized weights (a quantized checkpoint must be dequantized first")
    assert not (tmp_path / "out").exists()
    edit_tensors(hf, lambda s: s.update({q: s[q].float(), "model.norm.weight": torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(ValueError, match="model.safetensors: tensor 'model.norm.weight' has dtype I64, not floating"):
        check_hf_weight_files(hf, model_config_from_hf(load_hf_config(hf)))


def _convert_tool():
    """tools/convert_checkpoint.py as a module (its ``parse_args`` and ``main``, without a process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_config_yaml_with_a_partial_or_no_model_section(tmp_path):
    """Training allows ``model: {max_position_embeddings: 256}`` with init_from; export crashed with a TypeError
    (missing 6 required arguments), and a YAML without ``model:`` was blamed for unknown fields ['checkpoint', ...]."""
    import json
    from dataclasses import asdict, replace

    import yaml

    from packsft.model.config import ModelConfig
    from packsft.model.lora import LoraConfig
    from packsft.train.convert import export_sections
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128, kv_channels=32, rotary_base=50000.0)
    lora = LoraConfig(enabled=True, rank=2, alpha=4.0)
    run = {"data": {"max_seq_len": 64}, "optimizer": {"lr": 1e-3}}

    def config(name, **sections):
        (tmp_path / name).write_text(yaml.safe_dump({**run, **sections}))
        return str(tmp_path / name)

    partial = config("partial.yaml", model={"max_position_embeddings": 256}, lora=asdict(lora))
    longer = replace(cfg, max_position_embeddings=256)
    saved = {"config": yaml.safe_dump({"model": asdict(cfg), "lora": asdict(lora)})}  # a LoRA run's train_state
    assert export_sections(tmp_path / "iter_0000002", partial, saved) == (longer, lora)
    saved = {"config": yaml.safe_dump({"model": asdict(cfg)})}
    assert export_sections(tmp_path / "iter_0000002", config("none.yaml"), saved) == (cfg, None)

    imported = tmp_path / "imported"                    # an imported folder: its model_config.json
    imported.mkdir()
    (imported / "model_config.json").write_text(json.dumps(asdict(cfg)))
    partial = config("partial_base.yaml", model={"max_position_embeddings": 256})
    assert export_sections(imported, partial, None) == (longer, None)
    with pytest.raises(ValueError, match=r"model.rotary_base \(7.0\) differs from .*imported/model_config.json "
                                         r"\(50000.0\): the weights have the latter"):
        export_sections(imported, config("bad.yaml", model={"rotary_base": 7.0}), None)

    empty = tmp_path / "empty"                          # nothing to take the rest from
    empty.mkdir()
    for yaml_file in (partial, config("no_model.yaml")):
        with pytest.raises(ValueError, match=r"\.yaml: missing ModelConfig fields \['num_layers', 'hidden_size', "
                                             r".*a partial model section takes the rest from"):
            export_sections(empty, yaml_file, None)
    with_init = config("init.yaml", model={"max_position_embeddings": 256}, checkpoint={"init_from": str(imported)})
    assert export_sections(empty, with_init, None) == (longer, None)      # as training resolves it
    # a model_config.json given as --config over an imported folder: it exported another rope base, exit 0
    wrong = tmp_path / "wrong_model_config.json"
    wrong.write_text(json.dumps(asdict(replace(cfg, rotary_base=10000.0))))
    with pytest.raises(ValueError, match=r"model.rotary_base \(10000.0\) differs from .*imported/model_config.json"):
        export_sections(imported, str(wrong), None)
    same = tmp_path / "same_model_config.json"
    same.write_text(json.dumps(asdict(replace(cfg, max_position_embeddings=256))))  # a free key
    assert export_sections(imported, str(same), None) == (longer, None)


@pytest.mark.parametrize(("base", "message"), [
    # every layer a window of 8 tokens for a model trained on 128 (logits off by more than their size)
    ({"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     "sliding_window=8"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),      # transformers adds zero biases
    ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "llama", "rms_norm_eps": 1e-3, "hidden_act": "gelu"}, None),   # replaced by the model's: fine
])
def test_export_hf_config_fields_that_change_the_model_are_refused(base, message):
    """``--hf-config`` fields other than the shape were copied as they are: an export transformers runs differently
    from the trained model, exit 0."""
    from packsft.model.config import ModelConfig
    from packsft.model.hf_config import hf_config_from_model_config

    qwen3 = base["model_type"] == "qwen3"
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128, kv_channels=32 if qwen3 else None,
                      qk_layernorm=qwen3)
    if message is None:
        exported = hf_config_from_model_config(cfg, base=base)
        assert (exported.rms_norm_eps, exported.hidden_act) == (cfg.norm_epsilon, "silu")
        return
    with pytest.raises(ValueError, match=f"the exported config.json would not describe the trained model: .*{message}"):
        hf_config_from_model_config(cfg, base=base)


def test_export_hf_config_of_another_layer_count_is_a_user_error(tmp_path):
    """Its layer_types (3) against num_layers 2: huggingface_hub's StrictDataclassClassValidationError, exit 1."""
    import json
    from dataclasses import asdict

    from transformers import Qwen3Config

    from packsft.model.config import ModelConfig
    from packsft.model.hf_config import hf_config_from_model_config

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128, kv_channels=32, qk_layernorm=True)
    other = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=256)
    message = "transformers refuses the qwen3 config.json built from it and the model config: `num_hidden_layers` " \
              "(2) must be equal to the number of `layer_types` (3)"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf_config_from_model_config(cfg, base=other.to_dict())
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "mg").mkdir()
    (tmp_path / "mg" / "model_config.json").write_text(json.dumps(asdict(cfg)))    # refused before any weight is read
    hf_config = tmp_path / "other" / "config.json"
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                "--hf-config", hf_config), f"--hf-config {hf_config}: {message}")
    assert not (tmp_path / "out").exists()


def test_qwen3_gguf_of_another_head_dim_is_a_user_error(tmp_path, monkeypatch):
    """transformers reads every Qwen3 GGUF as head_dim 128: a head_dim 16 one failed with its RuntimeError."""
    from test_hf_io import hf_model, write_tiny_gguf

    gguf = tmp_path / "qwen3.gguf"
    write_tiny_gguf(hf_model("qwen3", seed=15, head_dim=16), gguf, arch="qwen3")
    assert_user_error(*call_tool(CONVERT, "import", "--hf", gguf, "--out", tmp_path / "out"),
                      f"{gguf}: its attention heads are 16 wide (qwen3.attention.key_length), but transformers' GGUF "
                      "loader builds head_dim 128")
    assert not (tmp_path / "out").exists()
    import gguf as gguf_package  # a GGUF without key_length: transformers' shape check, caught

    monkeypatch.setattr(gguf_package.GGUFWriter, "add_key_length", lambda self, n: None)
    monkeypatch.setattr(gguf_package.GGUFWriter, "add_value_length", lambda self, n: None)
    bare = tmp_path / "bare.gguf"
    write_tiny_gguf(hf_model("qwen3", seed=15, head_dim=16), bare, arch="qwen3")
    with pytest.raises(ValueError, match=f"{bare}: its tensors do not have the shapes of the config transformers' "
                                         "GGUF loader derives from it"):
        load_hf_checkpoint(bare)


def test_gguf_folder_of_several_files_and_a_truncated_gguf_are_named(tmp_path):
    """Two .gguf files: 'Unrecognized model ... model_type'; a truncated one: a numpy reshape error, no file."""
    from test_hf_io import hf_model, write_tiny_gguf

    folder = tmp_path / "ggufs"
    folder.mkdir()
    write_tiny_gguf(hf_model("llama", seed=13), folder / "a.gguf")
    shutil.copyfile(folder / "a.gguf", folder / "b.gguf")
    for read in (load_hf_config, load_hf_checkpoint):
        with pytest.raises(ValueError, match=f"{folder} holds 2 .gguf files \\(a.gguf, b.gguf\\): pass one of them"):
            read(folder)
    with open(folder / "b.gguf", "r+b") as f:
        f.truncate((folder / "b.gguf").stat().st_size - 1000)
    for read in (load_hf_config, load_hf_checkpoint):
        with pytest.raises(ValueError, match=f"{folder / 'b.gguf'}: not readable as a GGUF model: cannot reshape"):
            read(folder / "b.gguf")


def test_a_config_field_of_the_wrong_type_is_one_line(tmp_path):
    """``"rms_norm_eps": "abc"``: huggingface_hub's StrictDataclassFieldValidationError, a traceback and exit 1."""
    import json

    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": "abc"}))
    with pytest.raises(ValueError, match=f"^{tmp_path}: config.json has an invalid field: .*rms_norm_eps"):
        load_hf_config(tmp_path)


def test_a_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")          # was transformers' "Should have a model_type key"
    with pytest.raises(ValueError, match=f"^{tmp_path}: no config.json"):
        load_hf_config(tmp_path)


def test_a_config_with_zero_heads_is_one_line(tmp_path):
    """``"num_attention_heads": 0``: a ZeroDivisionError in transformers' validation, a traceback and exit 1."""
    import json

    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(ValueError, match=f"^{tmp_path}: config.json has an invalid field: .*ZeroDivisionError"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(("text", "message"), [("{oops", "not valid JSON"), ("[]", "a JSON array, not an object")])
def test_damaged_json_files_are_named(tmp_path, text, message):
    """A garbled ``hf_config.json``, ``model_config.json`` or safetensors index was ``error: Expecting value: line 1
    column 1 (char 0)`` naming no file; a JSON array as ``hf_config.json`` was read as no config."""
    from packsft.model.config import read_model_config
    from packsft.model.hf_files import _safetensors_files, read_hf_config

    for name, read in (("hf_config.json", read_hf_config), ("model_config.json", read_model_config),
                       ("model.safetensors.index.json", _safetensors_files)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"^{tmp_path / name}: {message}"):
            read(tmp_path)


def test_export_as_a_model_type_packsft_does_not_write_is_one_line():
    """``--hf-config`` of a Gemma 3 (or GPT-2) config: ``KeyError: 'gemma3_text'`` after transformers built it."""
    from packsft.model.config import ModelConfig
    from packsft.model.hf_config import hf_config_from_model_config

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128)
    for model_type in ("gemma3_text", "gpt2"):
        with pytest.raises(ValueError, match=f"model_type '{model_type}' cannot be exported; packsft writes llama, "):
            hf_config_from_model_config(cfg, base={"model_type": model_type, "hidden_size": 64})


def test_export_onto_a_base_of_another_family_names_the_field_it_would_lose():
    """A Qwen2 model (q/k/v biases) exported with a Llama base: Llama's config.json has no attention bias."""
    from packsft.model.config import ModelConfig
    from packsft.model.hf_config import hf_config_from_model_config

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, max_position_embeddings=128, add_qkv_bias=True)
    with pytest.raises(ValueError, match=r"^the exported config.json would not describe the trained model "
                                         r"\(add_qkv_bias: False against the model's True\)$"):
        hf_config_from_model_config(cfg, base={"model_type": "llama"})

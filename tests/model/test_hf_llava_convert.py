"""tools/convert_checkpoint.py on HF LLaVA-1.5 folders: import -> megatron LLaVAModel checkpoint (+ vision_config.json)
-> export -> LlavaForConditionalGeneration.from_pretrained with the same tensors and logits; refusals by HF key;
``checkpoint.init_from`` of an imported LLaVA."""

import argparse
import importlib.util
import json
import shutil
from dataclasses import asdict

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_hf_llava import CLIP_LAYERS, IMAGE_ID, hf_llava, unused
from test_tools_errors import TOOLS, assert_user_error, call_tool
from transformers import AutoProcessor, LlamaConfig, LlavaForConditionalGeneration

from examples.shapes_dataset import llava_processor_folder
from packsft.data.multimodal import load_processor
from packsft.train.compat import load_train_config
from packsft.train.convert_llava import export_llava, import_llava, resolve_image_token

CONVERT = TOOLS / "convert_checkpoint.py"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny random HF LLaVA (save_pretrained) and its import: ``(model, hf_dir, megatron_dir)``."""
    tmp = tmp_path_factory.mktemp("llava")
    model = hf_llava(seed=7)
    model.save_pretrained(tmp / "hf")
    rc, stderr = call_tool(CONVERT, "import", "--hf", tmp / "hf", "--out", tmp / "mg")
    assert rc == 0, stderr[-3000:]
    return model, tmp / "hf", tmp / "mg"


def logits(model, tokens, pixels):
    with torch.no_grad():
        return model(input_ids=tokens, pixel_values=pixels).logits


def test_import_writes_the_model_and_vision_configs(imported):
    model, _, mg = imported
    vision = json.loads((mg / "vision_config.json").read_text())
    assert vision == {"hidden_size": 32, "num_layers": CLIP_LAYERS - 1, "num_attention_heads": 4,
                      "ffn_hidden_size": 64, "image_size": 28, "patch_size": 14, "num_channels": 3,
                      "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu", "projector_hidden_act": "gelu",
                      "image_token_id": IMAGE_ID}
    text = json.loads((mg / "model_config.json").read_text())
    assert (text["num_layers"], text["hidden_size"], text["vocab_size"]) == (2, 64, 300)
    assert json.loads((mg / "hf_config.json").read_text())["model_type"] == "llava"
    assert (mg / ".metadata").is_file()


def test_export_loads_in_transformers_with_the_same_tensors_and_logits(imported, tmp_path):
    model, _, mg = imported
    rc, stderr = call_tool(CONVERT, "export", "--megatron", mg, "--out", tmp_path / "hf")
    assert rc == 0, stderr[-3000:]
    exported = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    original, back = model.state_dict(), exported.state_dict()
    assert all(torch.equal(back[k], original[k]) for k in original if not unused(k))
    assert exported.config.vision_config.num_hidden_layers == CLIP_LAYERS - 1
    tokens = torch.tensor([[5, 6] + [IMAGE_ID] * 4 + [7, 8, 9]])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits(exported, tokens, pixels), logits(model, tokens, pixels), atol=1e-5, rtol=0)
    rc, stderr = call_tool(CONVERT, "export", "--megatron", mg, "--out", tmp_path / "hf", "--dtype", "bfloat16")
    assert rc == 0, stderr[-3000:]                        # a previous export is replaced
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}


def test_export_copies_the_processor(tmp_path, tokenizer_dir):
    """The processor folder (smollm2's tokenizer + <image> = 49153 ids) as --tokenizer: its files in the export,
    which AutoProcessor loads; a model of fewer ids refuses it; a text tokenizer is refused as data.tokenizer is."""
    processor = llava_processor_folder(tmp_path / "processor", tokenizer_dir("smollm2-135m-instruct"))
    image_id = load_processor(processor)[1].image_token_id
    # a run with vision.image_token_id null took its processor's: the export's processor, else the HF config's
    assert resolve_image_token({"image_token_id": None}, str(processor), None, "w")["image_token_id"] == image_id
    assert resolve_image_token({"image_token_id": None}, None, {"image_token_index": 7}, "w")["image_token_id"] == 7
    with pytest.raises(ValueError, match="w: image_token_id is null .* pass --tokenizer"):
        resolve_image_token({"image_token_id": None}, None, None, "w")
    text = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=image_id + 64, max_position_embeddings=256)
    hf_llava(seed=1, text_config=text, image_token_index=image_id).save_pretrained(tmp_path / "hf")
    rc, stderr = call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    plain = tokenizer_dir("smollm2-135m-instruct")    # a text tokenizer (no <image>): refused as data.tokenizer is
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                 "--tokenizer", plain), f"--tokenizer: {plain}: the processor is a ")
    assert not (tmp_path / "out").exists()
    rc, stderr = call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                           "--tokenizer", processor)
    assert rc == 0, stderr[-3000:]
    assert {"processor_config.json", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in (tmp_path / "out").iterdir()}
    loaded = AutoProcessor.from_pretrained(tmp_path / "out", local_files_only=True)
    assert loaded.tokenizer.convert_tokens_to_ids("<image>") == image_id
    assert LlavaForConditionalGeneration.from_pretrained(tmp_path / "out").config.image_token_index == image_id
    (tmp_path / "mg" / "model_config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "mg" / "model_config.json").read_text()), "vocab_size": image_id}))
    assert_user_error(*call_tool(CONVERT, "export", "--megatron", tmp_path / "mg", "--out", tmp_path / "out",
                                 "--tokenizer", processor), f"model.vocab_size ({image_id}) is smaller than the "
                                                             "tokenizer")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.update(vision_feature_select_strategy="full"), "unsupported LLaVA config "
                                                                 "vision_feature_select_strategy='full'"),
    (lambda c: c.update(model_type="llava_next", image_grid_pinpoints=[[28, 56]]),
     "unsupported LLaVA config model_type='llava_next'"),
    (lambda c: c["text_config"].update(model_type="qwen2"), "unsupported LLaVA config text_config.model_type='qwen2'"),
], ids=["select_strategy", "llava_next", "qwen2_text"])
def test_unsupported_configs_are_one_error_line_by_key(imported, tmp_path, edit, message):
    _, hf, _ = imported
    shutil.copytree(hf, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    edit(config)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert_user_error(*call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg"), message)
    assert not (tmp_path / "mg").exists()


def test_bad_weight_files_are_named_before_the_model_is_built(imported, tmp_path):
    _, hf, _ = imported
    shutil.copytree(hf, tmp_path / "hf")
    state = load_file(hf / "model.safetensors")
    name = "vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, tmp_path / "hf" / "model.safetensors")
    assert_user_error(*call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg"),
                      "HF checkpoint has no tensor 'model.vision_tower.encoder.layers.0.self_attn.q_proj.weight'")
    state["multi_modal_projector.linear_2.weight"] = torch.zeros(64, 32)
    save_file(state, tmp_path / "hf" / "model.safetensors")
    assert_user_error(*call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg"),
                      "HF tensor 'multi_modal_projector.linear_2.weight' has shape (64, 32), but the config "
                      "implies (64, 64)")
    state["multi_modal_projector.linear_2.weight"] = torch.zeros(64, 64)
    state["multi_modal_projector.linear_3.weight"] = torch.zeros(64, 64)
    save_file(state, tmp_path / "hf" / "model.safetensors")
    assert_user_error(*call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg"),
                      "1 tensor(s) that its config.json does not use, e.g. ['multi_modal_projector.linear_3.weight']")
    assert not (tmp_path / "mg").exists()


def test_init_from_merges_the_vision_section_and_refuses_contradictions(imported, tmp_path):
    _, _, mg = imported
    config = tmp_path / "llava.yaml"           # no model: or vision: section: both come from init_from
    config.write_text(yaml.safe_dump({
        "data": {"backend": "energon", "train_path": str(tmp_path / "ds"), "tokenizer": str(tmp_path / "processor"),
                 "max_seq_len": 128, "energon": {"model_family": "llava"}},
        "train": {"train_steps": 2, "global_batch_size": 1}, "checkpoint": {"init_from": str(mg)}}))
    cfg = load_train_config(config)
    assert asdict(cfg.vision) == json.loads((mg / "vision_config.json").read_text())
    assert asdict(cfg.model) == json.loads((mg / "model_config.json").read_text())
    assert load_train_config(config, ["vision.image_size=28"]).vision == cfg.vision
    # null (a config such as configs/tiny_llava_cpu.yaml writes it): the processor's, which is the import's id
    assert load_train_config(config, ["vision.image_token_id=null"]).vision == cfg.vision
    with pytest.raises(ValueError, match=r"vision.image_size \(56\) differs from checkpoint.init_from's "
                                         r"vision_config.json \(28\): the weights have the latter"):
        load_train_config(config, ["vision.image_size=56"])
    with pytest.raises(ValueError, match="holds a LLaVA model .* and the config sets vision: null"):
        load_train_config(config, ["vision=null", "data.energon.model_family=null"])
    text = tmp_path / "text"                    # the same folder without vision_config.json: a text model
    shutil.copytree(mg, text)
    (text / "vision_config.json").unlink()
    with pytest.raises(ValueError, match="holds a text model .no vision_config.json."):
        load_train_config(config, [f"checkpoint.init_from={text}", "vision.hidden_size=32", "vision.num_layers=2",
                                   "vision.num_attention_heads=4", "vision.ffn_hidden_size=64",
                                   "vision.image_size=28", "vision.patch_size=14"])


@pytest.mark.skipif(importlib.util.find_spec("megatron.energon") is None, reason="needs megatron.energon")
def test_training_starts_from_the_import_and_its_checkpoint_exports(tmp_path, tokenizer_dir):
    """import -> train.py with checkpoint.init_from (no model: / vision: section; lr 1e-20: the weights stay) ->
    export of its checkpoint, the processor from the run's data.tokenizer: the original HF tensors come back."""
    from test_loop import train

    from examples.shapes_dataset import shapes_dataset

    processor = llava_processor_folder(tmp_path / "processor", tokenizer_dir("smollm2-135m-instruct"))
    image_id = load_processor(processor)[1].image_token_id
    text = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=image_id + 1, max_position_embeddings=256)
    model = hf_llava(seed=4, text_config=text, image_token_index=image_id)
    model.save_pretrained(tmp_path / "hf")
    rc, stderr = call_tool(CONVERT, "import", "--hf", tmp_path / "hf", "--out", tmp_path / "mg")
    assert rc == 0, stderr[-3000:]
    config = tmp_path / "llava.yaml"
    config.write_text(yaml.safe_dump({
        "data": {"backend": "energon", "train_path": str(shapes_dataset(tmp_path / "ds")), "tokenizer": str(processor),
                 "max_seq_len": 128, "energon": {"model_family": "llava", "buffer_size": 8,
                                                  "shuffle_buffer_size": 4}},
        "optimizer": {"lr": 1e-20, "weight_decay": 0.0}, "scheduler": {"warmup_steps": 1},
        "train": {"global_batch_size": 2, "train_steps": 1}, "checkpoint": {"init_from": str(tmp_path / "mg")},
        "logging": {"output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False}}))
    train(config)
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000001"
    rc, stderr = call_tool(CONVERT, "export", "--megatron", checkpoint, "--out", tmp_path / "out")
    assert rc == 0, stderr[-3000:]
    assert f"copied from the run's data.tokenizer {processor}" in stderr
    assert (tmp_path / "out" / "processor_config.json").is_file()
    exported = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert exported.config.image_token_index == image_id
    original, back = model.state_dict(), exported.state_dict()
    for name in (k for k in original if not unused(k)):
        torch.testing.assert_close(back[name], original[name], atol=1e-12, rtol=0, msg=name)



def test_a_pipeline_split_is_refused_before_anything_is_read():
    args = argparse.Namespace(pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-size 2: a LLaVA model is imported as one "):
        import_llava(args, None, None)
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-size 2: a LLaVA model is exported as one "):
        export_llava(args, None, None, None, "", None)

"""HF <-> Megatron conversion: layouts, logits parity with transformers (fp32), round trips, refusals."""

import json

import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from packsft.data.context_parallel import make_packed_seq_params
from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.model.hf_config import (
    full_attention_length,
    hf_config_from_model_config,
    model_config_from_hf,
    sliding_window,
)
from packsft.model.hf_files import load_hf_checkpoint, write_hf_checkpoint
from packsft.model.hf_io import load_hf_state_into_model, save_hf_checkpoint
from packsft.model.state_dict_adapter import hf_to_megatron_state_dict, megatron_to_hf_state_dict

VOCAB = 256
LENGTHS = [7, 12, 5, 8]
CONFIGS = {  # one tied, two untied; rope_theta and rms_norm_eps differ from every default
    "llama": (LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False)),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False)),   # sliding_window 4096 >= 128: never reached
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=False, head_dim=32)),   # q/k norms; head_dim != 64 / 4
}


def hf_config(family, **overrides):
    cls, extra = CONFIGS[family]
    fields = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rope_theta=50000.0,
                  rms_norm_eps=1e-6, **extra)
    return cls(**{**fields, **overrides})


def hf_model(family, seed=0, **overrides):
    """A random tiny HF model; every weight (norms and Qwen2 biases included) is perturbed away from init."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def megatron_from_hf(model):
    cfg = model_config_from_hf(model.config)
    megatron = build_gpt_model(cfg).eval()
    load_hf_state_into_model(megatron, model.state_dict(), cfg)
    return megatron, cfg


def megatron_logits(model, tokens, position_ids, packed_seq_params=None):
    with torch.no_grad():
        return model(tokens, position_ids, None, packed_seq_params=packed_seq_params)[0]   # [t, v] fp32


def test_qkv_layout_is_interleaved_per_query_group():
    cfg = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=4, num_query_groups=2,
                      vocab_size=8, max_position_embeddings=8)                      # hn = 2, 2 q heads per group
    q, k, v = torch.arange(8.0)[:, None], 100 + torch.arange(4.0)[:, None], 200 + torch.arange(4.0)[:, None]
    state = {"model.embed_tokens.weight": torch.zeros(8, 8), "model.norm.weight": torch.ones(8),
             "lm_head.weight": torch.zeros(8, 8), "model.layers.0.input_layernorm.weight": torch.ones(8),
             "model.layers.0.post_attention_layernorm.weight": torch.ones(8),
             "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
             "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": torch.zeros(8, 8),
             "model.layers.0.mlp.gate_proj.weight": torch.full((8, 8), 1.0),
             "model.layers.0.mlp.up_proj.weight": torch.full((8, 8), 2.0),
             "model.layers.0.mlp.down_proj.weight": torch.zeros(8, 8)}
    shards = [hf_to_megatron_state_dict(state, cfg, r, 2) for r in range(2)]
    qkv = [s["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist() for s in shards]
    assert qkv == [[0, 1, 2, 3, 100, 101, 200, 201], [4, 5, 6, 7, 102, 103, 202, 203]]
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist()
    assert fc1 == [1.0] * 4 + [2.0] * 4                                            # cat(gate_r, up_r)
    back = megatron_to_hf_state_dict(shards, cfg)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("family", CONFIGS)
def test_tp2_shards_reassemble_exactly(family):
    model = hf_model(family)
    cfg = model_config_from_hf(model.config)
    full = hf_to_megatron_state_dict(model.state_dict(), cfg)
    shards = [hf_to_megatron_state_dict(model.state_dict(), cfg, r, 2) for r in range(2)]
    qkv = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([s[qkv] for s in shards]), full[qkv])           # whole groups per rank
    assert shards[0]["decoder.layers.1.mlp.linear_fc2.weight"].shape == (64, 48)
    back = megatron_to_hf_state_dict(shards, cfg)
    expected = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


@pytest.mark.parametrize("family", CONFIGS)
def test_logits_equal_transformers_unpacked(parallel_state_1proc, family):  # noqa: F811
    model = hf_model(family)
    megatron, cfg = megatron_from_hf(model)
    assert cfg.add_qkv_bias == (family == "qwen2") and cfg.rotary_base == 50000.0 and cfg.norm_epsilon == 1e-6
    assert cfg.qk_layernorm == (family == "qwen3") and cfg.head_dim == (32 if family == "qwen3" else 16)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits[0]
    torch.testing.assert_close(megatron_logits(megatron, tokens, torch.arange(24)[None]), expected,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", CONFIGS)
def test_packed_row_logits_equal_each_conversation_alone(parallel_state_1proc, family):  # noqa: F811
    model = hf_model(family, seed=2)
    megatron, _ = megatron_from_hf(model)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    tokens = torch.randint(0, VOCAB, (1, int(cu[-1])), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    packed = megatron_logits(megatron, tokens, position_ids, make_packed_seq_params(cu, max(LENGTHS)))
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        with torch.no_grad():
            alone = model(tokens[:, s:e]).logits[0]
        torch.testing.assert_close(packed[s:e], alone, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_export_loads_in_transformers_and_reimports_exactly(parallel_state_1proc, family, tmp_path,  # noqa: F811
                                                            tokenizer_dir):
    model = hf_model(family, seed=4, vocab_size=49152)          # the tokenizer's 49152 tokens, or export refuses it
    megatron, cfg = megatron_from_hf(model)
    source_tok = tokenizer_dir("smollm2-135m-instruct")
    out = save_hf_checkpoint(megatron, cfg, tmp_path / "hf", hf_config=model.config, tokenizer_dir=source_tok)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]          # no temp folder left
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(model).__name__]
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.chat_template == AutoTokenizer.from_pretrained(source_tok).chat_template

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(megatron_logits(megatron, tokens, torch.arange(16)[None]), reloaded(tokens).logits[0],
                               atol=1e-4, rtol=0)

    hf_config2, hf_state = load_hf_checkpoint(out)
    cfg2 = model_config_from_hf(hf_config2)
    assert cfg2 == cfg
    again = build_gpt_model(cfg2)
    load_hf_state_into_model(again, hf_state, cfg2)
    before, after = megatron.state_dict(), again.state_dict()
    params = [k for k, v in before.items() if isinstance(v, torch.Tensor)]
    assert params and all(torch.equal(before[k], after[k]) for k in params)


def test_export_without_original_config_builds_llama(parallel_state_1proc, tmp_path):  # noqa: F811
    model = hf_model("mistral", seed=6)
    megatron, cfg = megatron_from_hf(model)
    out = save_hf_checkpoint(megatron, cfg, tmp_path / "hf", dtype=torch.bfloat16)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(reloaded).__name__ == "LlamaForCausalLM" and reloaded.dtype == torch.bfloat16
    assert model_config_from_hf(reloaded.config) == cfg


def test_export_without_original_config_takes_token_ids_from_tokenizer(parallel_state_1proc, tmp_path,  # noqa: F811
                                                                       tokenizer_dir):
    # Qwen2.5's eos <|im_end|> is 151645, no bos, pad <|endoftext|>; LlamaConfig's defaults would say bos 1 / eos 2
    model = hf_model("llama", seed=7, vocab_size=151936)
    megatron, cfg = megatron_from_hf(model)
    out = save_hf_checkpoint(megatron, cfg, tmp_path / "hf", tokenizer_dir=tokenizer_dir("qwen2.5"))
    written = json.loads((out / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (None, 151645, 151643)
    tok = AutoTokenizer.from_pretrained(out)
    assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == tok.eos_token_id == 151645
    kept = save_hf_checkpoint(megatron, cfg, tmp_path / "kept", hf_config={**model.config.to_dict(), "eos_token_id": 7},
                              tokenizer_dir=tokenizer_dir("qwen2.5"))
    assert json.loads((kept / "config.json").read_text())["eos_token_id"] == 7      # the HF config's ids win


def test_export_refuses_a_tokenizer_larger_than_the_vocabulary(parallel_state_1proc, tmp_path,  # noqa: F811
                                                               tokenizer_dir):
    megatron, cfg = megatron_from_hf(hf_model("llama", seed=8))
    with pytest.raises(ValueError, match=r"model.vocab_size \(256\) is smaller than the tokenizer .*qwen2.5 "
                                         r"\(151665 tokens\)"):
        save_hf_checkpoint(megatron, cfg, tmp_path / "hf", tokenizer_dir=tokenizer_dir("qwen2.5"))
    assert not (tmp_path / "hf").exists()


def test_sharded_safetensors_have_an_index(tmp_path):
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}        # 1 KiB each
    write_hf_checkpoint(state, hf_config("llama"), tmp_path / "hf", max_shard_bytes=2048)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    from safetensors.torch import load_file

    loaded = {}
    for name in set(index["weight_map"].values()):
        loaded.update(load_file(tmp_path / "hf" / name))
    assert all(torch.equal(loaded[k], state[k]) for k in state) and index["metadata"]["total_size"] == 4096


def test_llama3_rope_scaling_matches_transformers(parallel_state_1proc):  # noqa: F811
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = hf_model("llama", rope_parameters=rope)
    megatron, cfg = megatron_from_hf(model)
    assert cfg.rope_scaling_factor == 32.0
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(tokens).logits[0]
    torch.testing.assert_close(megatron_logits(megatron, tokens, torch.arange(24)[None]), expected,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_linear_rope_scaling_matches_transformers(parallel_state_1proc, family):  # noqa: F811
    rope = {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}
    model = hf_model(family, rope_parameters=rope)
    megatron, cfg = megatron_from_hf(model)
    assert cfg.rope_interpolation_factor == 4.0 and cfg.rope_scaling_factor is None
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = model(tokens).logits[0]
    got = megatron_logits(megatron, tokens, torch.arange(24)[None])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    plain, _ = megatron_from_hf(hf_model(family))          # same weights (seed 0), unscaled RoPE: the test can fail
    assert (megatron_logits(plain, tokens, torch.arange(24)[None]) - expected).abs().max() > 1e-3
    exported = model_config_from_hf(hf_config_from_model_config(cfg, base=model.config))
    assert exported == cfg


def test_gemma3_is_refused_with_what_is_missing():
    for model_type in ("gemma3_text", "gemma3"):
        with pytest.raises(ValueError, match="Gemma 3.*GeGLU.*sqrt.*1 \\+ w.*soft-capping.*sliding-window"):
            model_config_from_hf(AutoConfig.for_model(model_type))


@pytest.mark.parametrize(("family", "overrides", "message"), [
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                    "original_max_position_embeddings": 32768}), "rope_type 'yarn'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), "'dynamic'"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding_window=64.*layers 0-1"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(attention_dropout=0.1), "attention_dropout"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 2.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
     "low_freq_factor"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=64, max_window_layers=1), "sliding_window=64.* layer 1:"),
    ("mistral", dict(sliding_window=64), "sliding_window=64"),
])
def test_unsupported_options_are_refused_by_name(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf_config(family, **overrides))


def test_unsupported_model_type_and_reachable_window():
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        model_config_from_hf(AutoConfig.for_model("gpt2"))
    windowed = hf_config("mistral", sliding_window=64)
    cfg = model_config_from_hf(windowed, max_seq_len=64)
    assert cfg.max_position_embeddings == 64                 # training then refuses rows the window would cut
    assert hf_config_from_model_config(cfg, windowed.to_dict()).max_position_embeddings == 128  # export: the original
    with pytest.raises(ValueError, match="max_seq_len <= 64"):
        model_config_from_hf(windowed, max_seq_len=65)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_window_only_from_max_window_layers(family):
    # transformers: layers >= max_window_layers slide; 2 layers, max_window_layers 2 -> full attention everywhere
    full = hf_config(family, use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert sliding_window(full) is None and sliding_window(full.to_dict()) is None
    assert model_config_from_hf(full).max_position_embeddings == 128
    windowed = hf_config(family, use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert windowed.layer_types == ["full_attention", "sliding_attention"]
    assert sliding_window(windowed) == 64 and full_attention_length(windowed.to_dict()) == 64
    assert model_config_from_hf(windowed, max_seq_len=64).max_position_embeddings == 64
    off = hf_config(family, use_sliding_window=False, sliding_window=64, max_window_layers=0)
    assert sliding_window(off) is None


def test_sliding_window_of_a_config_without_layer_types():
    """A config.json saved by transformers 4 has no layer_types: Qwen2's rule and Mistral's window apply."""
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 64,
            "max_window_layers": 3, "max_position_embeddings": 128}
    assert sliding_window(qwen) == 64 and full_attention_length(qwen) == 64
    assert sliding_window({**qwen, "max_window_layers": 4}) is None
    no_mwl = {k: v for k, v in qwen.items() if k != "max_window_layers"}   # transformers' default: 28
    assert sliding_window({**no_mwl, "num_hidden_layers": 28}) is None
    assert sliding_window({**no_mwl, "num_hidden_layers": 32}) == 64 == sliding_window(
        hf_config("qwen2", num_hidden_layers=32, use_sliding_window=True, sliding_window=64))
    assert sliding_window({**qwen, "use_sliding_window": False}) is None
    mistral = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 256, "max_position_embeddings": 128}
    assert sliding_window(mistral) == 256 and full_attention_length(mistral) is None
    assert sliding_window({**mistral, "sliding_window": None}) is None
    with pytest.raises(ValueError, match="sliding_window is null"):
        sliding_window({"model_type": "llama", "layer_types": ["sliding_attention"], "sliding_window": None})


def _permute_for_gguf(w, n_head):
    """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``: HF rotate-half rows -> GGUF interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model, path, arch="llama"):
    """An F32 GGUF of ``model`` written the way llama.cpp's converter does (metadata, names, q/k permute).

    ``llama``: q/k rows permuted (``LlamaModel.permute``); ``qwen3``: not permuted, plus ``attn_q_norm`` /
    ``attn_k_norm`` and ``output.weight`` (untied), as ``Qwen3Model`` writes them.
    """
    gguf = pytest.importorskip("gguf")
    c, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in [("context_length", c.max_position_embeddings), ("block_count", c.num_hidden_layers),
                       ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                       ("head_count", c.num_attention_heads), ("head_count_kv", c.num_key_value_heads),
                       ("rope_freq_base", 50000.0), ("layer_norm_rms_eps", c.rms_norm_eps),
                       ("rope_dimension_count", c.head_dim), ("vocab_size", c.vocab_size)]:
        getattr(writer, f"add_{add}")(value)
    if arch == "qwen3":
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if arch == "qwen3":
        names.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads} if arch == "llama" else {}
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            w = _permute_for_gguf(w, heads[gguf_name]) if gguf_name in heads else w
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", w.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_import_matches_transformers(parallel_state_1proc, tmp_path):  # noqa: F811
    model = hf_model("llama", seed=13)                                     # tied: the GGUF has no output.weight
    write_tiny_gguf(model, tmp_path / "tiny.gguf")
    for source in (tmp_path / "tiny.gguf", tmp_path):                       # the file, or a folder holding one
        hf_cfg, hf_state = load_hf_checkpoint(source)
        assert all(torch.equal(hf_state[k], v) for k, v in model.state_dict().items())   # q/k un-permuted
    cfg = model_config_from_hf(hf_cfg)
    assert (cfg.tie_word_embeddings, cfg.rotary_base, cfg.num_query_groups) == (True, 50000.0, 2)
    megatron = build_gpt_model(cfg).eval()
    load_hf_state_into_model(megatron, hf_state, cfg)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        expected = model(tokens).logits[0]
    torch.testing.assert_close(megatron_logits(megatron, tokens, torch.arange(24)[None]), expected,
                               atol=1e-4, rtol=0)


def test_qwen3_gguf_import_matches_transformers(parallel_state_1proc, tmp_path):  # noqa: F811
    # transformers' GGUF reader ignores qwen3.attention.key_length and keeps Qwen3Config's head_dim 128 (that of
    # every released Qwen3 dense model), so the GGUF model must have head_dim 128
    model = hf_model("qwen3", seed=15, head_dim=128)
    write_tiny_gguf(model, tmp_path / "qwen3.gguf", arch="qwen3")
    hf_cfg, hf_state = load_hf_checkpoint(tmp_path / "qwen3.gguf")
    assert hf_cfg.model_type == "qwen3" and hf_cfg.head_dim == 128
    assert all(torch.equal(hf_state[k], v) for k, v in model.state_dict().items())
    cfg = model_config_from_hf(hf_cfg)
    assert cfg.qk_layernorm and cfg.kv_channels == 128
    megatron = build_gpt_model(cfg).eval()
    load_hf_state_into_model(megatron, hf_state, cfg)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        expected = model(tokens).logits[0]
    torch.testing.assert_close(megatron_logits(megatron, tokens, torch.arange(24)[None]), expected,
                               atol=1e-4, rtol=0)


def test_missing_checkpoint_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(KeyError, match="model.norm.weight"):
        state = {k: v for k, v in hf_model("qwen2").state_dict().items() if k != "model.norm.weight"}
        hf_to_megatron_state_dict(state, model_config_from_hf(hf_config("qwen2")))


def test_te_backend_uses_fused_norm_names():
    model = hf_model("qwen2")
    cfg = model_config_from_hf(model.config, attention_backend="te")
    state = hf_to_megatron_state_dict(model.state_dict(), cfg)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in state
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in state
    assert not [k for k in state if "input_layernorm" in k or "pre_mlp_layernorm" in k]
    back = megatron_to_hf_state_dict([state], cfg)
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_export_keeps_the_original_context_length():
    cfg = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2, num_query_groups=2,
                      vocab_size=16, max_position_embeddings=512)        # trained on shorter rows than the original
    base = {"model_type": "llama", "max_position_embeddings": 2048}
    assert hf_config_from_model_config(cfg, base=base).max_position_embeddings == 2048
    assert hf_config_from_model_config(cfg).max_position_embeddings == 512
    longer = {**base, "max_position_embeddings": 256}
    assert hf_config_from_model_config(cfg, base=longer).max_position_embeddings == 512

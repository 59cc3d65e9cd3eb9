"""LoRA runs end to end: ``tools/train.py`` from an imported base, then ``tools/convert_checkpoint.py export``.

A tiny random Qwen3 (hidden 64, 2 layers, vocab 49152 for the SmolLM2 tokenizer's real gsm8k rows) is imported as
the base; LoRA rank 4 on all four targets trains 4 steps (torch AdamW, 2 rows per step). Checked: the checkpoints
hold only the adapters and the base's identity, stop + resume is bit-exact, a different base is refused by name,
the merged and PEFT exports give the packsft LoRA model's logits (fp32, 1e-5), and a TP=2 run (2 gloo processes)
exports the adapter of the TP=1 run.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from distributed_helpers import parallel_state_1proc, run_distributed, tool_forked  # noqa: F401 - fixture
from test_hf_io import hf_model, megatron_from_hf
from test_init_from import convert_in_process, convert_worker
from test_loop import SEQ, assert_same_run, packed  # noqa: F401 - fixture

from packsft.model.config import read_model_config
from packsft.model.gpt import build_gpt_model
from packsft.model.lora import LoraConfig, apply_lora
from packsft.train.model_checkpoint import base_identity, load_megatron_checkpoint, save_megatron_checkpoint

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
STEPS = 4


def _hf_base(seed):
    return hf_model("qwen3", seed=seed, vocab_size=49152, max_position_embeddings=SEQ)


def _import(model, out: Path) -> Path:
    """What ``convert_checkpoint.py import`` writes for ``model`` (in process: faster than the CLI)."""
    megatron, cfg = megatron_from_hf(model)
    return save_megatron_checkpoint(megatron, cfg, out, hf_config=model.config)


def _run(tool: Path, *args, nproc=1, check=True) -> subprocess.CompletedProcess:
    """``tools/<name>.py args`` on ``nproc`` ranks: the tool's ``main`` in forks of the tests' fork server
    (:func:`distributed_helpers.tool_forked`)."""
    return tool_forked(tool.stem, *args, nproc=nproc, check=check, env={"HF_HUB_OFFLINE": "1"}, timeout_s=400)


def _config(tmp: Path, packed, base: Path, name: str) -> Path:  # noqa: F811
    cfg = {"data": {"train_path": str(packed["many"]), "tokenizer": str(packed["tokenizer"]), "max_seq_len": SEQ},
           # adam_eps 1e-4: a gradient near 0 differs between TP sizes by float rounding, and Adam's step
           # lr * g / (|g| + eps) turns that into up to lr / eps times as large a difference of the weight
           "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "adam_eps": 1e-4},
           "scheduler": {"warmup_steps": 1, "decay_style": "constant"},
           "train": {"global_batch_size": 2, "train_steps": STEPS},
           "checkpoint": {"init_from": str(base)},
           "logging": {"output_dir": str(tmp / name), "progress": False, "tensorboard": False}, "lora": LORA}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, *overrides, nproc=1, check=True):
    return _run(REPO / "tools" / "train.py", "--config", config, *overrides, nproc=nproc, check=check)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, packed, parallel_state_1proc):  # noqa: F811
    """The imported base, and a finished 4-step LoRA run from it (its config and run folder)."""
    tmp = tmp_path_factory.mktemp("lora_run")
    hf = _hf_base(11)
    base = _import(hf, tmp / "base")
    config = _config(tmp, packed, base, "full")
    _train(config)
    return {"tmp": tmp, "hf": hf, "base": base, "config": config, "run": tmp / "full"}


def _last(run: Path) -> Path:
    return run / "checkpoints" / f"iter_{STEPS:07d}"


def test_checkpoints_hold_adapters_and_base_identity_and_resume_exactly(lora_run, packed):  # noqa: F811
    from megatron.core.dist_checkpointing import load_plain_tensors

    tmp, base = lora_run["tmp"], lora_run["base"]
    last = _last(lora_run["run"])
    model = [k for k in load_plain_tensors(str(last)) if not k.startswith("optimizer")]
    assert model and all(".lora_" in k for k in model), sorted(model)[:4]         # no base weight
    state = json.loads((last / "train_state.json").read_text())
    assert state["lora_base"] == base_identity(base) and state["lora_base"]["path"] == str(base.resolve())
    full_bytes = sum(f.stat().st_size for f in base.iterdir())
    lora_bytes = sum(f.stat().st_size for f in last.glob("*.distcp"))
    print(f"base folder {full_bytes} bytes, LoRA checkpoint shards {lora_bytes} bytes")
    assert lora_bytes < full_bytes / 10

    parts = _config(tmp, packed, base, "parts")
    _train(parts, "train.stop_at_step=2")
    _train(parts)                                   # resumes from iter_0000002: base from init_from, then adapters
    assert_same_run(lora_run["run"], tmp / "parts", steps=STEPS)
    summary = [json.loads(x) for x in (tmp / "parts" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lora_base"]["fingerprint"] for r in summary if r["kind"] == "summary"] == [state["lora_base"][
        "fingerprint"]] * 2

    other = _import(_hf_base(12), tmp / "other_base")
    proc = _train(parts, f"checkpoint.init_from={other}", f"checkpoint.resume={tmp / 'parts/checkpoints/iter_0000002'}",
                  f"logging.output_dir={tmp / 'parts_other'}", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert error and str(base.resolve()) in error[0] and str(other.resolve()) in error[0], proc.stderr[-3000:]
    print(error[0])
    proc = _train(parts, "lora.alpha=16", check=False)   # the same weights, scaled otherwise: refused by name
    last = tmp / "parts" / "checkpoints" / "iter_0000004"
    expected = f"error: lora.alpha is 16.0 but checkpoint {last} was trained with 8.0;"
    assert proc.returncode == 2 and any(line.startswith(expected) for line in proc.stderr.splitlines()), \
        proc.stderr[-3000:]
    proc = _train(parts, "optimizer.use_distributed_optimizer=true", check=False)  # another optimizer state format
    expected = f"error: optimizer.use_distributed_optimizer is True but checkpoint {last} was trained with False"
    assert proc.returncode == 2 and any(line.startswith(expected) for line in proc.stderr.splitlines()), \
        proc.stderr[-3000:]


def _packsft_lora_logits(lora_run, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [t, v] of the packsft model: base folder + the run's adapters, unmerged (fp32)."""
    cfg = read_model_config(lora_run["run"] / "config.yaml")
    model = build_gpt_model(cfg).eval()
    apply_lora(model, LoraConfig(**LORA))
    load_megatron_checkpoint(model, lora_run["base"], base_only=True)
    load_megatron_checkpoint(model, _last(lora_run["run"]), adapters_only=True)
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1])[None], None)[0]


def _export(lora_run, *flags, checkpoint=None, nproc=1, config=True, check=True):
    """``export`` of the run's last checkpoint; ``config``: pass the run's config.yaml (else the recorded one)."""
    checkpoint = checkpoint or _last(lora_run["run"])
    config = ("--config", checkpoint.parents[1] / "config.yaml") if config is True else config or ()
    return _run(REPO / "tools" / "convert_checkpoint.py", "export", "--megatron", checkpoint, *config, *flags,
                nproc=nproc, check=check)


@pytest.fixture(scope="module")
def tp1_export(lora_run, packed):  # noqa: F811
    """The TP=1 run's last checkpoint exported (CLI) as base ``hf_base`` (with the tokenizer) + PEFT ``adapter``,
    its ``--config`` the base's model_config.json (no lora section: the one the checkpoint records)."""
    tmp = lora_run["tmp"]
    _export(lora_run, "--out", tmp / "hf_base", "--lora-adapter", tmp / "adapter", "--tokenizer", packed["tokenizer"],
            config=("--config", lora_run["base"] / "model_config.json"))
    return {"base": tmp / "hf_base", "adapter": tmp / "adapter"}


def test_cli_merged_and_peft_exports_give_the_lora_logits(lora_run, packed, tp1_export):  # noqa: F811
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from examples.generate import generate

    tmp, tokenizer = lora_run["tmp"], ("--tokenizer", packed["tokenizer"])
    tokens = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(4))
    expected = _packsft_lora_logits(lora_run, tokens)
    with torch.no_grad():
        base_logits = lora_run["hf"](tokens).logits[0]
    assert (expected - base_logits).abs().max() > 1e-3                      # the trained adapters matter
    _export(lora_run, "--out", tmp / "merged", "--merge-lora", *tokenizer, config=False)    # as train_state records
    other = yaml.safe_load((lora_run["run"] / "config.yaml").read_text())
    other["lora"]["alpha"] = 16.0
    (tmp / "other.yaml").write_text(yaml.safe_dump(other))
    proc = _export(lora_run, "--out", tmp / "wrong", "--merge-lora", config=("--config", tmp / "other.yaml"),
                   check=False)
    assert proc.returncode == 2 and "error: lora.alpha is 16.0 but checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp / "wrong").exists()
    (tmp / "a_file").write_text("x")      # the base cannot be written: no adapter is left without it
    proc = _export(lora_run, "--out", tmp / "a_file" / "base", "--lora-adapter", tmp / "orphan", check=False)
    assert proc.returncode == 2 and "error: " in proc.stderr and not (tmp / "orphan").exists(), proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp / "merged", dtype=torch.float32).eval()
    hf_base = AutoModelForCausalLM.from_pretrained(tp1_export["base"], dtype=torch.float32).eval()
    assert all(torch.equal(hf_base.state_dict()[k], v) for k, v in lora_run["hf"].state_dict().items())
    peft_model = PeftModel.from_pretrained(hf_base, tp1_export["adapter"]).eval()
    with torch.no_grad():
        merged_logits, peft_logits = merged(tokens).logits[0], peft_model(tokens).logits[0]
    print("max |logit diff| merged", float((merged_logits - expected).abs().max()),
          "peft", float((peft_logits - expected).abs().max()))
    torch.testing.assert_close(merged_logits, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(peft_logits, expected, atol=1e-5, rtol=0)
    # examples/generate.py --adapter: the chat template of the exported tokenizer, base + adapter through peft
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    answer = generate(tp1_export["base"], messages, 8, adapter_dir=tp1_export["adapter"])
    assert answer == generate(tmp / "merged", messages, 8) and answer != generate(tp1_export["base"], messages, 8)


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.distributed
def test_tp2_run_exports_the_adapter_of_the_tp1_run(lora_run, packed, tp1_export):  # noqa: F811
    """The TP=2 run's adapter exported in this process (TP=1) and in one 2-process spawn (TP=2) equals the TP=1
    run's."""
    tmp = lora_run["tmp"]
    tp2 = _config(tmp, packed, lora_run["base"], "tp2")
    _train(tp2, "parallel.tensor_model_parallel_size=2", nproc=2)
    assert json.loads((_last(tmp / "tp2") / "train_state.json").read_text())["layout"][
        "tensor_model_parallel_size"] == 2
    export = ("export", "--megatron", _last(tmp / "tp2"), "--config", tmp / "tp2" / "config.yaml")
    convert_in_process(*export, "--out", tmp / "tp2_base", "--lora-adapter", tmp / "tp2_adapter")
    run_distributed(convert_worker, 2, (*export, "--out", tmp / "tp2_base_at2", "--lora-adapter",
                                        tmp / "tp2_adapter_at2", "--tensor-model-parallel-size", "2"), timeout_s=400)
    tp1, tp2_at1, tp2_at2 = (_adapter(d) for d in (tp1_export["adapter"], tmp / "tp2_adapter", tmp / "tp2_adapter_at2"))
    assert tp1.keys() == tp2_at1.keys() == tp2_at2.keys() and len(tp1) == 2 * 7 * 2   # q,k,v,o,gate,up,down x A,B
    assert all(torch.equal(tp2_at1[k], tp2_at2[k]) for k in tp1)          # the same files at either export TP
    worst = max(float((tp1[k] - tp2_at1[k]).abs().max()) for k in tp1)
    moved = min(float(v.abs().max()) for k, v in tp1.items() if "lora_B" in k)
    print(f"TP=2 run vs TP=1 run, max |adapter diff| {worst:.2e}; smallest max |B| {moved:.2e}")
    assert worst < 1e-5 and moved > 1e-3
    assert json.loads((tmp / "tp2_adapter" / "adapter_config.json").read_text())["r"] == 4

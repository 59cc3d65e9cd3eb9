"""Training from imported Hugging Face weights (``checkpoint.init_from``): the first loss is the HF model's loss on
the same row, a found resume checkpoint wins over ``init_from``, and a contradicting ``model`` section is refused."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from distributed_helpers import parallel_state_1proc, run_distributed, tool_forked  # noqa: F401 - fixture

from packsft.data.dataset import PackedSFTDataset
from packsft.packing.config import PackConfig
from packsft.packing.pipeline import run_pack
from packsft.train.compat import load_train_config

REPO = Path(__file__).resolve().parents[2]
SEQ = 256
ENV = {"OMP_NUM_THREADS": "1", "PATH": "", "HF_HUB_OFFLINE": "1"}


def tiny_hf_llama(seed: int = 0, num_layers: int = 2):
    """A random tied Llama (hidden 64, ``num_layers`` layers, 4 heads / 2 KV heads) over the SmolLM2 vocabulary
    (49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         rope_theta=50000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():   # move the norms off 1.0 so that a missed norm weight changes the loss
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def run(tool: str, *args: str, cwd: Path = REPO, check: bool = True) -> subprocess.CompletedProcess:
    """``python tools/<name>.py args`` run in ``cwd``: the tool's ``main`` in a fork of the tests' fork server
    (:func:`distributed_helpers.tool_forked`, environment :data:`ENV`); raise on a non-zero exit when ``check``."""
    return tool_forked(Path(tool).stem, *args, env=ENV, cwd=cwd, check=check)


def convert_in_process(*args) -> None:
    """``tools/convert_checkpoint.py args`` in this process, at the layout ``args`` name (an export writes only
    safetensors; an import saves through dist_checkpointing, which needs the guarded ``__main__`` pytest has)."""
    from packsft.train import convert
    from tools.convert_checkpoint import parse_args

    assert convert.run(parse_args([str(a) for a in args])) == 0


def convert_worker(rank, world_size, *jobs):
    """:func:`convert_in_process` of each job's arguments in turn, on every rank of a :func:`run_distributed`."""
    for args in jobs:
        convert_in_process(*args)


def train_worker(rank, world_size, *argvs):
    """``tools/train.py``'s ``main`` of each argument list in turn, on every rank of a :func:`run_distributed`."""
    from tools.train import main

    for argv in argvs:
        assert main([str(a) for a in argv]) == 0


def pack_and_save_hf(out: Path, shared_data: Path, tokenizer_dir) -> dict:
    """Packed gsm8k rows (SmolLM2 tokenizer, 256 tokens) and a tiny HF Llama saved to ``out / "hf"``; ``imported``
    names the folder its import is to be written to (``out / "imported"``)."""
    src = out / "chats.jsonl"
    lines = (shared_data / "chat" / "gsm8k_test.messages.jsonl").read_text().splitlines()
    src.write_text("\n".join(lines[:8]) + "\n")
    tokenizer = tokenizer_dir("smollm2-135m-instruct")
    run_pack(PackConfig(inputs=[str(src)], output=str(out / "rows.jsonl.packed"), max_seq_len=SEQ,
                        tokenizer=str(tokenizer), histogram="", progress=False, oversize="drop"))
    hf = tiny_hf_llama()
    hf.save_pretrained(out / "hf")
    return {"dir": out, "rows": out / "rows.jsonl.packed", "tokenizer": tokenizer, "hf": hf,
            "imported": out / "imported"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data, tokenizer_dir):
    """:func:`pack_and_save_hf` and the Megatron checkpoint ``tools/convert_checkpoint.py import`` writes of it."""
    setup = pack_and_save_hf(tmp_path_factory.mktemp("init_from"), shared_data, tokenizer_dir)
    run("tools/convert_checkpoint.py", "import", "--hf", str(setup["dir"] / "hf"), "--out", str(setup["imported"]))
    return setup


def write_config(setup: dict, name: str, **model) -> Path:
    """A YAML with no ``model`` section (it comes from ``init_from``), sequential rows, 1 row per step, 2 steps."""
    cfg = {"data": {"train_path": str(setup["rows"]), "tokenizer": str(setup["tokenizer"]), "max_seq_len": SEQ},
           "loader": {"sampler": "sequential"},
           "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
           "scheduler": {"decay_style": "constant"},
           "train": {"global_batch_size": 1, "train_steps": 2},
           "checkpoint": {"init_from": str(setup["imported"])},
           "logging": {"output_dir": str(setup["dir"] / name), "progress": False, "tensorboard": False}}
    if model:
        cfg["model"] = model
    path = setup["dir"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def records(output_dir: Path, kind: str) -> list[dict]:
    """The ``metrics.jsonl`` records of one kind, in file order."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def hf_row_loss(model, row: dict) -> float:
    """Mean token loss of packed ``row`` under a transformers model, each conversation run alone from position 0."""
    cu = row["cu_seqlens_padded"].tolist()
    total, count = 0.0, 0.0
    with torch.no_grad():
        for s, e in zip(cu[:-1], cu[1:]):
            logits = model(input_ids=row["tokens"][s:e].unsqueeze(0)).logits[0].float()
            labels, mask = row["labels"][s:e], row["loss_mask"][s:e] * (row["labels"][s:e] != -100)
            ce = torch.nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")
            total += float((ce * mask).sum())
            count += float(mask.sum())
    return total / count


@pytest.mark.slow
def test_first_loss_is_the_hf_models_and_resume_wins(setup):
    full = setup["dir"] / "full"          # read for its metrics only: tools/train.py's main in a 1-process spawn
    run_distributed(train_worker, 1, ("--config", write_config(setup, "full"), "checkpoint.save_at_end=false"))
    summary, = records(full, "summary")
    assert summary["initialized_from"] == str(setup["imported"]) and summary["resumed_from"] is None
    train = {r["step"]: r for r in records(full, "train")}
    row = PackedSFTDataset(setup["rows"], setup["tokenizer"], "chat-template", SEQ)[0]
    expected = hf_row_loss(setup["hf"], row)
    assert train[1]["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert train[1]["trained_tokens"] == row["num_trained_tokens"]

    # stop after step 1, then rerun: the checkpoint found by resume=auto wins over init_from (same step 2 as `full`);
    # init_from given relative to the folder training runs in
    parts_cfg = write_config(setup, "parts")
    relative = os.path.relpath(setup["imported"], REPO)
    parts_cfg.write_text(parts_cfg.read_text().replace(str(setup["imported"]), relative))
    run("tools/train.py", "--config", str(parts_cfg), "train.stop_at_step=1")
    run("tools/train.py", "--config", str(parts_cfg))
    first, second = records(setup["dir"] / "parts", "summary")
    assert first["initialized_from"] == relative and first["resumed_from"] is None
    assert second["initialized_from"] is None and second["resumed_from"].endswith("iter_0000001")
    parts = {r["step"]: r for r in records(setup["dir"] / "parts", "train")}
    assert parts[2]["loss"] == train[2]["loss"] and parts[2]["grad_norm"] == train[2]["grad_norm"]
    assert train[2]["loss"] != train[1]["loss"]

    # the init_from folder is gone (moved, a scratch purge): a resume needs only the checkpoint
    moved = setup["imported"].with_name("imported_moved")
    setup["imported"].rename(moved)
    try:
        proc = run("tools/train.py", "--config", str(parts_cfg), "train.train_steps=3")
        with pytest.raises(FileNotFoundError, match="model_config.json not found"):   # nothing to resume
            load_train_config(parts_cfg, ["checkpoint.resume=none"])
        with pytest.raises(ValueError, match=r"model.rotary_base \(1.0\) differs from the model section checkpoint "
                                             r".*iter_0000003 records \(50000.0\)"):
            load_train_config(parts_cfg, ["model.rotary_base=1.0"])
    finally:
        moved.rename(setup["imported"])
    assert f"note: checkpoint.init_from='{relative}' has no model_config.json; the run resumes" in proc.stderr
    assert records(setup["dir"] / "parts", "summary")[-1]["resumed_from"].endswith("iter_0000002")
    assert [r["step"] for r in records(setup["dir"] / "parts", "train")] == [1, 2, 3]

    # export without --config / --hf-config, from another folder: the recorded model section, the HF config of the
    # folder the run started from (train_state.json records it as an absolute path)
    hf_config = setup["imported"] / "hf_config.json"
    hf_config.write_text(json.dumps({**json.loads(hf_config.read_text()), "initializer_range": 0.0123}))
    last = setup["dir"] / "parts" / "checkpoints" / "iter_0000002"
    assert json.loads((last / "train_state.json").read_text())["init_from"] == str(setup["imported"].resolve())
    run(str(REPO / "tools" / "convert_checkpoint.py"), "export", "--megatron", str(last),
        "--out", str(setup["dir"] / "hf_out"), "--tokenizer", str(setup["tokenizer"]), cwd=setup["dir"])
    exported = json.loads((setup["dir"] / "hf_out" / "config.json").read_text())
    assert exported["model_type"] == "llama" and exported["rms_norm_eps"] == 1e-6
    assert exported["initializer_range"] == 0.0123                        # from init_from's hf_config.json
    assert 50000.0 in (exported.get("rope_theta"), (exported.get("rope_parameters") or {}).get("rope_theta"))


def test_model_section_comes_from_the_checkpoint_and_must_agree(setup):
    cfg = load_train_config(write_config(setup, "fill"))
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.vocab_size) == (64, 2, 49152)
    assert cfg.model.rotary_base == 50000.0 and cfg.model.tie_word_embeddings
    free = load_train_config(write_config(setup, "free", max_position_embeddings=4096)).model
    assert free.max_position_embeddings == 4096
    recompute = load_train_config(write_config(setup, "recompute", recompute_granularity="selective")).model
    assert recompute.recompute_granularity == "selective"       # recompute shapes no weight: free to differ
    with pytest.raises(ValueError, match=r"model.hidden_size \(128\) differs .*model_config.json \(64\)"):
        load_train_config(write_config(setup, "bad", hidden_size=128))


def test_init_from_without_model_config_is_named(setup, tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint.init_from=.*model_config.json not found"):
        load_train_config(write_config(setup, "missing"), [f"checkpoint.init_from={tmp_path}"])


def test_rows_longer_than_the_imported_sliding_window_are_refused(setup, tmp_path):
    """A Mistral imported with --max-seq-len <= its window records the window as max_position_embeddings; a config
    that raises model.max_position_embeddings (a free key) still may not train rows past the window."""
    windowed = tmp_path / "windowed"
    shutil.copytree(setup["imported"], windowed)
    hf = json.loads((windowed / "hf_config.json").read_text())
    (windowed / "hf_config.json").write_text(json.dumps({**hf, "model_type": "mistral", "sliding_window": SEQ // 2,
                                                         "max_position_embeddings": 4 * SEQ}))
    config = write_config(setup, "windowed", max_position_embeddings=4 * SEQ)
    with pytest.raises(ValueError, match=rf"max_seq_len \({SEQ}\) is longer than the sliding_window \({SEQ // 2}\)"):
        load_train_config(config, [f"checkpoint.init_from={windowed}"])
    assert load_train_config(config, [f"checkpoint.init_from={windowed}", f"data.max_seq_len={SEQ // 2}"])


def test_an_unreadable_init_from_checkpoint_is_one_error_line(setup, tmp_path):
    """torch's reader wraps a truncated .distcp in a BaseException (CheckpointException): one error line, exit 2."""
    broken = tmp_path / "broken"
    shutil.copytree(setup["imported"], broken)
    shard = sorted(broken.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    proc = run("tools/train.py", "--config", str(write_config(setup, "broken")), f"checkpoint.init_from={broken}",
               check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and f"error: {broken}: cannot load the checkpoint" in errors[0], proc.stderr[-3000:]


def _vpp_worker(rank, world_size, config, runs):
    """Per run (overrides): a Trainer at PP=2 x VP=2 from ``init_from``; validation of 1 batch and of all rows, then
    one step."""
    from megatron.core import parallel_state

    from packsft.train.loop import Trainer

    out = []
    for overrides in runs:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer = Trainer(load_train_config(config, overrides))
        one = trainer.validate()                                   # validation.max_batches=1: 1 micro-batch < PP
        trainer.cfg.validation.max_batches = None
        every = trainer.validate()
        out.append({"one": one, "every": every, "step": trainer.train_step(trainer.next_micro_batches()),
                    "layout": trainer.layout(), "stages": [(g.pre_process, g.post_process) for g in trainer.gpts]})
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_virtual_pipeline_stages_start_from_an_import_and_validate_any_number_of_rows(setup, parallel_state_1proc):  # noqa: F811
    """A 4-layer import loaded at PP=2 x VP=2 (4 model chunks of 1 layer; plain and as a LoRA base, whose zero
    ``lora_B`` leaves the loss the base's): the validation loss of 1 row (fewer micro-batches than stages) and of
    every row, and the first training loss over rows 0 and 1, are transformers' (one load of all chunks: each chunk
    loaded alone failed with megatron's 'Invalid access pattern'; 1 validation micro-batch failed in the interleaved
    schedule)."""
    hf = tiny_hf_llama(seed=3, num_layers=4)
    hf.save_pretrained(setup["dir"] / "hf4")
    imported = setup["dir"] / "imported4"
    convert_in_process("import", "--hf", setup["dir"] / "hf4", "--out", imported)
    common = [f"checkpoint.init_from={imported}", "parallel.pipeline_model_parallel_size=2",
              "parallel.virtual_pipeline_model_parallel_size=2", "optimizer.backend=megatron",
              "train.global_batch_size=2", f"data.validation_path={setup['rows']}", "validation.max_batches=1"]
    runs = [[*common, f"logging.output_dir={setup['dir'] / 'vpp'}"],
            [*common, f"logging.output_dir={setup['dir'] / 'vpp_lora'}", "lora.enabled=true", "lora.rank=4"]]
    per_rank = run_distributed(_vpp_worker, 2, write_config(setup, "vpp"), runs, timeout_s=400)
    dataset = PackedSFTDataset(setup["rows"], setup["tokenizer"], "chat-template", SEQ)
    rows = [dataset[i] for i in range(len(dataset))]
    sums = [hf_row_loss(hf, row) * row["num_trained_tokens"] for row in rows]
    counts = [row["num_trained_tokens"] for row in rows]
    expected = {"one": sums[0] / counts[0], "every": sum(sums) / sum(counts), "step": sum(sums[:2]) / sum(counts[:2])}
    assert len(rows) % 2 == 1       # the full pass ends with 1 micro-batch too
    for rank, results in enumerate(per_rank):
        for result in results:
            assert result["layout"]["virtual_pipeline_model_parallel_size"] == 2
            assert result["stages"] == [[(True, False), (False, False)], [(False, False), (False, True)]][rank]
            got = {"one": result["one"]["val_loss"], "every": result["every"]["val_loss"],
                   "step": result["step"]["loss"]}
            print("rank", rank, "loss", got, "transformers", expected)
            assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
            assert result["one"]["val_trained_tokens"] == counts[0]
            assert result["every"]["val_trained_tokens"] == sum(counts)
            assert result["step"]["trained_tokens"] == sum(counts[:2])

"""Training a tiny random LLaVA-1.5 (CLIP 2 layers hidden 32, language model 2 layers hidden 64, the smollm2 vocabulary
plus ``<image>``) on the shapes Energon dataset with packsft's trainer: the loss falls with the fused loss; a run
stopped at step 3 and resumed in a new process has the same next batch and the same losses as the uninterrupted
run; a changed vision key at resume is refused by name; the fused loss equals Megatron's cross-entropy on the
logits and reads the images; the config refusals."""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.energon")

from distributed_helpers import parallel_state_1proc  # noqa: E402, F401 - fixture
from test_energon_loader import _next_batch_after_restore  # noqa: E402
from test_loop import REPO, train_forked, train_records, write_config  # noqa: E402

from examples.shapes_dataset import llava_processor_folder, shapes_dataset  # noqa: E402
from packsft.train.checkpoint_files import CheckpointError  # noqa: E402
from packsft.train.compat import check_recorded_vision  # noqa: E402
from packsft.train.config import load_config  # noqa: E402
from packsft.train.config_vision import vlm_config  # noqa: E402

SEQ = 128
VISION = {"hidden_size": 32, "num_layers": 2, "num_attention_heads": 2, "ffn_hidden_size": 64, "image_size": 28,
          "patch_size": 14}
STEPS = {"train": {"global_batch_size": 2, "train_steps": 6}, "checkpoint": {"save_interval": 0},
         "scheduler": {"warmup_steps": 1}, "validation": {"val_period": 3}}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, tokenizer_dir):
    """What ``python tests/data/shapes.py OUT`` writes: ``OUT/ds`` (Energon: 7 train samples, 1 val) and the tiny
    LLaVA processor folder ``OUT/processor`` (4 image tokens per image)."""
    root = tmp_path_factory.mktemp("vlm_train")
    return {"few": shapes_dataset(root / "ds"),
            "tokenizer": llava_processor_folder(root / "processor", tokenizer_dir("smollm2-135m-instruct"))}


def _config(folder, shapes, **sections):
    """The tiny LLaVA run's YAML in ``folder`` (output ``folder/out``); ``sections`` update its sections."""
    folder.mkdir(parents=True, exist_ok=True)
    energon = {"model_family": "llava", "buffer_size": 8, "shuffle_buffer_size": 4, "validation_split": "val"}
    return write_config(folder / "c.yaml", shapes, folder / "out", **{
        "model": {"vocab_size": 49153, "max_position_embeddings": SEQ},     # smollm2's 49152 + <image>
        "vision": dict(VISION), **sections,
        "data": {"backend": "energon", "max_seq_len": SEQ, "energon": energon, **sections.get("data", {})}})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, shapes):
    """The 6-step run the stopped and resumed one must reproduce: its config and output folder."""
    folder = tmp_path_factory.mktemp("full")
    config = _config(folder, shapes, **STEPS)
    train_forked(config)
    return config, folder / "out"


def test_a_tiny_llava_learns_and_logs_image_and_text_tokens(uninterrupted):
    _, out = uninterrupted
    records = train_records(out)
    assert sorted(records) == list(range(1, 7))
    assert records[6]["loss"] < records[1]["loss"] - 0.5, (records[1]["loss"], records[6]["loss"])
    for r in records.values():         # 4 ids per image; the rows' real tokens are the image and text tokens
        assert r["image_tokens"] > 0 and r["image_tokens"] % 4 == 0 and r["text_tokens"] > r["trained_tokens"] > 0
        assert r["image_tokens"] + r["text_tokens"] == round(r["packing_efficiency"] * 2 * SEQ)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in lines if r["kind"] == "validation"]
    assert [r["step"] for r in val] == [3, 6] and all(r["val_trained_tokens"] > 0 for r in val)
    summary = next(r for r in lines if r["kind"] == "summary")
    assert summary["train_samples"] == 7 and summary["validation_rows"] == {"validation": 1}
    # CLIP: conv1 3*14*14*32 + class token and 5 positions + ln_pre + 2 layers; projector 32*64+64 + 64*64+64
    layer = 4 * 32 * 32 + 4 * 32 + 2 * 32 * 64 + 64 + 32 + 4 * 32
    assert summary["vision_parameters"] == 3 * 14 * 14 * 32 + 32 + 5 * 32 + 2 * 32 + 2 * layer
    assert summary["projector_parameters"] == 32 * 64 + 64 + 64 * 64 + 64 < summary["parameters"]


def test_a_micro_batch_of_two_rows_trains_as_two_micro_batches_of_one(tmp_path, shapes, uninterrupted):
    """Two rows in one THD micro-batch (2 x 128 tokens, more than model.max_position_embeddings): LLaVAModel keeps
    the whole combined sequence; the losses are the one-row micro-batches'."""
    _, full = uninterrupted
    config = _config(tmp_path, shapes, **{**STEPS, "loader": {"micro_batch_size": 2},
                                          "train": {"global_batch_size": 2, "train_steps": 2}})
    train_forked(config)
    got, expected = train_records(tmp_path / "out"), train_records(full)
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5)
        assert got[step]["trained_tokens"] == expected[step]["trained_tokens"]


def test_a_stopped_run_resumes_in_a_new_process_with_the_same_batches_and_losses(tmp_path, shapes, uninterrupted):
    full_config, full = uninterrupted
    config = _config(tmp_path, shapes, **STEPS)
    train_forked(config, "train.stop_at_step=3")
    saved = tmp_path / "out" / "checkpoints" / "iter_0000003"
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == saved.name
    recorded = json.loads((saved / "train_state.json").read_text())["config"]
    assert "vision:" in recorded and "model_family: llava" in recorded

    from packsft.train.data import build_datasets

    cfg = load_config(full_config)
    fresh = iter(build_datasets(cfg)[0].train_loader(cfg.loader, 0, 1))
    expected = [next(fresh) for _ in range(7)][6]                   # after 3 steps of 2 micro-batches
    got = _next_batch_after_restore(config, saved / "dataloader_dp0.pt", tmp_path / "next.pt", ("tokens", "images"))
    assert torch.equal(got["tokens"], expected["tokens"]) and torch.equal(got["images"], expected["images"])

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "train.py"), "--config", str(config),
                           "vision.hidden_act=gelu"], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert proc.returncode != 0
    assert f"vision.hidden_act is 'gelu' but checkpoint {saved} was trained with 'quick_gelu'" in proc.stderr

    train_forked(config)
    a, b = train_records(full), train_records(tmp_path / "out")
    for step in range(1, 7):
        assert a[step]["loss"] == b[step]["loss"] and a[step]["grad_norm"] == b[step]["grad_norm"], step
        assert (a[step]["image_tokens"], a[step]["text_tokens"]) == (b[step]["image_tokens"], b[step]["text_tokens"])
    val = [[json.loads(r)["val_loss"] for r in (run / "metrics.jsonl").read_text().splitlines() if '"val_loss"' in r]
           for run in (full, tmp_path / "out")]
    assert val[0] == val[1]


def test_recorded_vision_section_is_compared_whole(tmp_path, shapes):
    cfg = load_config(_config(tmp_path, shapes))
    recorded = {"vision": {**VISION, "image_token_id": None}}
    check_recorded_vision(cfg.vision, recorded, "ckpt", fix="set {key}={value}")
    check_recorded_vision(cfg.vision, {"vision": {**VISION, "image_token_id": 49152}}, "ckpt", fix="")
    assert cfg.vision.image_token_id == 49152                 # null (the processor's) takes the run's id
    with pytest.raises(CheckpointError, match=r"^vision.image_token_id is 7 but checkpoint ckpt was trained with "
                                              r"None; set vision.image_token_id=null$"):
        check_recorded_vision(load_config(_config(tmp_path, shapes), ["vision.image_token_id=7"]).vision, recorded,
                              "ckpt", fix="set {key}={value}")
    cfg = load_config(_config(tmp_path, shapes))
    with pytest.raises(CheckpointError, match=r"^vision.num_layers is 2 but checkpoint ckpt was trained with 3; "
                                              r"set vision.num_layers=3$"):
        check_recorded_vision(cfg.vision, {"vision": {**VISION, "num_layers": 3}}, "ckpt", fix="set {key}={value}")
    with pytest.raises(CheckpointError, match="the config has a vision: section but checkpoint ckpt was trained "
                                              "with no vision model"):
        check_recorded_vision(cfg.vision, {"vision": {}}, "ckpt", fix="")
    with pytest.raises(CheckpointError, match="the config has no vision: section but checkpoint ckpt was trained "
                                              "with a vision model"):
        check_recorded_vision(None, recorded, "ckpt", fix="")


def test_config_refusals_name_the_keys(tmp_path, shapes):
    config = _config(tmp_path, shapes)
    assert load_config(config).vision.image_token_id is None
    for overrides, message in (
            (["vision=null"], r"data.energon.model_family set needs vision \(got None\): an image-text dataset"),
            (["data.energon.model_family=null"], r"vision needs data.energon.model_family llava \(got None\)"),
            (["data.backend=packed", "data.energon=null"], r"vision needs data.backend energon \(got 'packed'\)"),
            (["lora.enabled=true", "model.attention_backend=torch"],
             r"vision needs lora.enabled False \(got True\): packsft's LoRA adapts a text model"),
            (["parallel.context_parallel_size=2"], r"vision needs parallel.context_parallel_size 1 \(got 2\): "
                                                   "megatron-core's LLaVAModel needs TransformerEngine"),
            (["parallel.pipeline_model_parallel_size=2"], r"vision needs parallel.pipeline_model_parallel_size 1 "
                                                          r"\(got 2\): packsft has no pipeline split"),
            (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
             r"vision needs parallel.sequence_parallel False \(got True\): .* only with TransformerEngine"),
            (["vision.image_size=30"], r"vision.image_size \(30\) must be a multiple of vision.patch_size \(14\)"),
            (["vision.hidden_act=relu"], r"vision.hidden_act must be one of \('quick_gelu', 'gelu'\), got 'relu'"),
            (["data.energon.model_family=qwen"], r"data.energon.model_family must be one of \('llava',\)")):
        with pytest.raises(ValueError, match=message):
            load_config(config, overrides)


def test_the_vision_section_must_match_the_processor(tmp_path, shapes):
    from packsft.data.multimodal import load_processor

    _, image = load_processor(shapes["tokenizer"])
    cfg = load_config(_config(tmp_path, shapes))
    assert vlm_config(cfg.model, cfg.vision, image).image_token_id == image.image_token_id == 49152
    for overrides, message in ((["vision.image_size=56"], r"vision.image_size \(56\) is not the crop of the "
                                                          r"processor of data.tokenizer \(28 x 28 pixels\)"),
                               (["vision.patch_size=7"], r"\(image_size / patch_size\) \*\* 2 = 16 image tokens per "
                                                         "image, the processor of data.tokenizer writes 4"),
                               (["vision.image_token_id=7"], r"vision.image_token_id \(7\) is not the id of the image "
                                                             r"token '<image>' of data.tokenizer \(49152\)")):
        other = load_config(_config(tmp_path, shapes), overrides)
        with pytest.raises(ValueError, match=message):
            vlm_config(other.model, other.vision, image)


def test_the_fused_loss_equals_the_stock_one_and_reads_the_images(tmp_path, shapes, parallel_state_1proc):  # noqa: F811
    """One step's loss of the same weights: the fused linear cross-entropy on LLaVA's hidden states equals Megatron's
    vocab-parallel cross-entropy on its logits; negated pixels change it (the images reach the loss)."""
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(_config(tmp_path, shapes, checkpoint={"resume": "none"})))
    trainer.optimizer.step_with_ready_grads = lambda: True                      # no update: the same weights
    batches = trainer.next_micro_batches()
    assert all(b["images"].shape[0] * 4 == b["num_image_tokens"] for b in batches)
    fused = trainer.train_step(batches)["loss"]
    trainer.schedule.cfg.loss.fused_linear_cross_entropy = False
    stock = trainer.train_step(batches)["loss"]
    assert abs(fused - stock) < 1e-5 * fused, (fused, stock)
    flipped = [{**b, "images": -b["images"]} for b in batches]
    assert abs(trainer.train_step(flipped)["loss"] - stock) > 1e-6


def test_the_packing_report_counts_text_and_image_tokens_of_the_rows_the_encoder_packs(tmp_path, shapes):
    from examples.shapes_dataset import conversations
    from packsft.data.multimodal import encode_image_text, load_processor
    from packsft.prompt_formats import Tokenization, TokenizationSpec
    from packsft.tokenizer import load_tokenizer
    from packsft.train.energon_report import energon_report

    config = _config(tmp_path, shapes)
    report = energon_report(load_config(config))
    processor, image = load_processor(shapes["tokenizer"])
    tokenizer = load_tokenizer(shapes["tokenizer"])
    spec = TokenizationSpec(str(shapes["tokenizer"]), "chat-template")
    tokenization = Tokenization.of(tokenizer, spec.bind(tokenizer))
    train = [encode_image_text(record, members, tokenization, processor, image)
             for _, record, members in conversations()[:7]]              # the train split: samples 0-6
    real = sum(len(e["tokens"]) for e in train)
    images = sum(len(e["pixel_values"]) for e in train)
    assert (report["samples"], report["conversations"], report["skipped"], report["images"]) == (7, 7, 0, images)
    assert report["image_tokens"] == images * image.image_seq_length == sum(e["num_image_tokens"] for e in train)
    assert report["text_tokens"] == real - report["image_tokens"]
    assert report["rows"] >= report["lower_bound_rows"] == -(-real // SEQ)
    assert report["padding_tokens"] == report["rows"] * SEQ - real
    assert report["efficiency"] == round(real / (report["rows"] * SEQ), 6)
    assert report["cut_image_tokens"] == 0

    # every conversation longer than a 16-token row: each cut in a row of its own, an image cut through dropped
    cut = energon_report(load_config(config, ["data.max_seq_len=16"]))
    kept = [(e, [p for p, t in enumerate(e["tokens"][:16]) if t == image.image_token_id]) for e in train]
    assert all(len(e["tokens"]) > 16 for e in train) and cut["rows"] == 7
    assert cut["images"] == sum(len(ids) // 4 for _, ids in kept)
    assert cut["image_tokens"] == 4 * cut["images"] and cut["cut_image_tokens"] == sum(len(ids) % 4 for _, ids in kept)
    assert cut["text_tokens"] == sum(16 - len(ids) for _, ids in kept)
    assert cut["trained_tokens"] == sum(sum(t != -100 for t in e["targets"][1:16]) for e in train)
    val = energon_report(load_config(config), "val")
    assert (val["split"], val["samples"], val["images"]) == ("val", 1, 1)

    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(REPO / "tools" / "energon_report.py"), "--config", str(config),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(out.read_text()) == report
    refused = subprocess.run([sys.executable, str(REPO / "tools" / "energon_report.py"), "--config",
                              str(REPO / "configs" / "tiny_cpu.yaml")], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.splitlines()[-1].startswith("error: ") and \
        "data.backend is 'packed'" in refused.stderr


@pytest.mark.distributed
def test_tensor_parallel_2_trains_as_tp_1(tmp_path, shapes):
    """TP=2 (torchrun, gloo) shards the language model, the projector and the CLIP layers; its losses, validation
    losses and gradient norms are the TP=1 run's (an even vocabulary: 49152 + <image> + 1 padding id)."""
    runs = {}
    for tp in (1, 2):
        config = _config(tmp_path / f"tp{tp}", shapes, model={"vocab_size": 49154, "max_position_embeddings": SEQ},
                         train={"global_batch_size": 2, "train_steps": 3}, checkpoint={"save_interval": 0},
                         scheduler={"warmup_steps": 1}, validation={"val_period": 3},
                         parallel={"tensor_model_parallel_size": tp})
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
        proc = subprocess.run([*launch, str(REPO / "tools" / "train.py"), "--config", str(config)],
                              capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""})
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = [json.loads(line) for line in (tmp_path / f"tp{tp}" / "out" / "metrics.jsonl").read_text().splitlines()]
        runs[tp] = [v for r in lines for v in ((r["loss"], r["grad_norm"]) if r["kind"] == "train" else
                                                (r.get("val_loss"),) if r["kind"] == "validation" else ())]
    assert len(runs[1]) == 7
    assert runs[2] == pytest.approx(runs[1], rel=2e-4)     # fp32 sums in another order (grad norm: ~5e-5)

"""Checkpoint layout, atomic publication, ``checkpoint.resume`` resolution, and model + AdamW round trip."""

import re

import pytest
import torch
from distributed_helpers import adam_state, megatron_optimizer, optimizer_step, parallel_state_1proc  # noqa: F401 - fixture

from packsft.model.config import ModelConfig
from packsft.model.gpt import build_gpt_model
from packsft.train import checkpoint as ckpt
from packsft.train import checkpoint_files as ckpt_files
from packsft.train.config import OptimizerConfig


def tiny_model(seed):
    torch.manual_seed(seed)
    return build_gpt_model(ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                                       num_query_groups=2, vocab_size=128, max_position_embeddings=32))


def one_step(model, opt):
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    optimizer_step(opt)


def test_resume_resolution(tmp_path):
    assert ckpt_files.find_resume_checkpoint(tmp_path, "none") is None
    assert ckpt_files.find_resume_checkpoint(tmp_path, "auto") is None                     # nothing saved yet
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / ckpt_files.TRAIN_STATE).write_bytes(b"x")
    (tmp_path / "latest").write_text("iter_0000004\n")
    assert ckpt_files.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "iter_0000004"
    assert ckpt_files.find_resume_checkpoint(tmp_path, str(tmp_path / "iter_0000004")) == tmp_path / "iter_0000004"
    with pytest.raises(FileNotFoundError, match="iter_0000009"):
        ckpt_files.find_resume_checkpoint(tmp_path, str(tmp_path / "iter_0000009"))


def test_save_load_round_trip_and_killed_save_leaves_previous(tmp_path, parallel_state_1proc):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig(lr=1e-2))
    for _ in range(2):
        one_step(model, opt)
    path = ckpt.save_checkpoint(tmp_path, 2, model, opt, train_state={"state": {"step": 2}}, loader_state={"x": 1},
                                dp_rank=0, write_loader_state=True)
    assert path == tmp_path / "iter_0000002" and (tmp_path / "latest").read_text() == "iter_0000002\n"
    names = {p.name for p in path.iterdir()}
    assert {ckpt_files.TRAIN_STATE, "dataloader_dp0.pt", "rng_rank0.pt", "metadata.json", "common.pt"} <= names
    # a save of step 3 killed half-way: its .tmp folder exists, `latest` still names step 2
    (tmp_path / "iter_0000003.tmp").mkdir()
    (tmp_path / "iter_0000003.tmp" / "__0_0.distcp").write_bytes(b"partial")
    assert ckpt_files.find_resume_checkpoint(tmp_path, "auto") == path

    fresh = tiny_model(1)
    fresh_opt = megatron_optimizer(fresh, OptimizerConfig(lr=1e-2))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    ckpt.load_model_and_optimizer(path, fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        sa, sb = adam_state(opt, a), adam_state(fresh_opt, b)
        assert float(sa["step"]) == float(sb["step"]) == 2.0
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    one_step(model, opt)
    one_step(fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)                                      # the next step is bit-identical too
    assert ckpt.load_loader_state(path, 0) == {"x": 1}
    with pytest.raises(FileNotFoundError, match="checkpoint.restore_data_order=false"):
        ckpt.load_loader_state(path, 1)


def test_rng_states_are_restored(tmp_path, parallel_state_1proc):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    torch.manual_seed(5)
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={}, loader_state=None, dp_rank=0,
                                write_loader_state=False)
    expected = torch.rand(3)
    torch.manual_seed(99)
    assert ckpt.load_rng_state(path, 0) and torch.equal(torch.rand(3), expected)
    assert not ckpt.load_rng_state(path, 7)          # another world size: this rank saved none
    with pytest.raises(ckpt.CheckpointError, match="rng_rank7.pt: missing, though the checkpoint was saved by as many"):
        ckpt.load_rng_state(path, 7, required=True)  # the same world size: a damaged folder (the resume was inexact)


@pytest.mark.parametrize("size", [0, 500])
@pytest.mark.parametrize("name", ["rng_rank0.pt", "dataloader_dp0.pt"])
def test_a_truncated_state_file_is_named(tmp_path, parallel_state_1proc, name, size):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={"state": {"step": 1}},
                                loader_state={"sampler_state": {}}, dp_rank=0, write_loader_state=True)
    with open(path / name, "r+b") as f:
        f.truncate(size)
    with pytest.raises(ckpt.CheckpointError, match=f"{name}: unreadable .*truncated or damaged"):  # RuntimeError
        ckpt.load_rng_state(path, 0) if name.startswith("rng") else ckpt.load_loader_state(path, 0)


def test_a_missing_common_pt_is_megatrons_error_not_a_crash(tmp_path, parallel_state_1proc):  # noqa: F811
    from megatron.core.dist_checkpointing.core import CheckpointingException

    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={}, loader_state=None, dp_rank=0,
                                write_loader_state=False)
    (path / "common.pt").unlink()
    with pytest.raises(CheckpointingException, match="common.pt does not exist"):   # an AttributeError before
        ckpt.load_model_and_optimizer(path, model, opt)


class _Payload:
    """Unpickling it writes ``marker``: what a planted ``__reduce__`` object would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_state_files_are_json_or_plain_tensors(tmp_path, parallel_state_1proc):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={"state": {"step": 1}, "layout": {"tp": 1}},
                                loader_state={"sampler_state": {"epoch": 0, "position": 2}}, dp_rank=0,
                                write_loader_state=True)
    assert ckpt_files.load_train_state(path) == {"state": {"step": 1}, "layout": {"tp": 1}}
    import json
    assert json.loads((path / "train_state.json").read_text())["state"] == {"step": 1}
    for name in ("rng_rank0.pt", "dataloader_dp0.pt"):
        torch.load(path / name, weights_only=True)          # loads without allowing any pickled class


@pytest.mark.parametrize("name", ["rng_rank0.pt", "dataloader_dp0.pt"])
def test_planted_payload_is_refused_and_never_runs(tmp_path, parallel_state_1proc, name):  # noqa: F811
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={"state": {"step": 1}},
                                loader_state={"sampler_state": {}}, dp_rank=0, write_loader_state=True)
    marker = tmp_path / "payload_ran"
    torch.save({"torch": torch.get_rng_state(), "evil": _Payload(marker)}, path / name)
    with pytest.raises(ckpt.CheckpointError, match=f"{name}: refused: .*nothing from it was executed"):
        if name.startswith("rng"):
            ckpt.load_rng_state(path, 0)
        else:
            ckpt.load_loader_state(path, 0)
    assert not marker.exists()
    torch.load(path / name, weights_only=False)                  # the payload is real: an unsafe load runs it
    assert marker.exists()


def test_old_pickled_checkpoint_is_refused_without_unpickling(tmp_path):
    old = tmp_path / "iter_0000004"
    old.mkdir()
    marker = tmp_path / "payload_ran"
    torch.save({"state": {"step": 4}, "evil": _Payload(marker)}, old / ckpt_files.OLD_TRAIN_STATE)
    (tmp_path / "latest").write_text("iter_0000004\n")
    with pytest.raises(ckpt.CheckpointError, match="old format .*can run code"):
        ckpt_files.find_resume_checkpoint(tmp_path, "auto")
    with pytest.raises(ckpt.CheckpointError, match="old format"):
        ckpt_files.load_train_state(old)
    assert not marker.exists()


TINY = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   vocab_size=128, max_position_embeddings=32)


def _lora_model(seed, base_dir):
    from packsft.model.lora import LoraConfig, apply_lora
    from packsft.train.model_checkpoint import load_megatron_checkpoint

    model = tiny_model(seed)
    apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8.0))
    load_megatron_checkpoint(model, base_dir, base_only=True)
    return model


def _logits_step(model, opt, seed):
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(seed))
    model(tokens, torch.arange(16)[None], None).float().square().mean().backward()
    optimizer_step(opt)


@pytest.mark.slow
def test_lora_checkpoint_holds_adapters_and_base_identity_and_resumes_bit_exact(
        tmp_path, parallel_state_1proc):  # noqa: F811
    import shutil

    from megatron.core.dist_checkpointing import load_plain_tensors

    from packsft.train.model_checkpoint import (
        FINGERPRINT_FILE,
        BaseMismatchError,
        base_identity,
        check_lora_base,
        save_megatron_checkpoint,
    )

    base_dir = save_megatron_checkpoint(tiny_model(0), TINY, tmp_path / "base")      # what `import` writes
    identity = base_identity(base_dir)
    assert identity == {"path": str(base_dir.resolve()), "fingerprint": identity["fingerprint"]}
    model = _lora_model(1, base_dir)
    opt = megatron_optimizer(model, OptimizerConfig(lr=1e-2))
    for seed in (1, 2):
        _logits_step(model, opt, seed)
    path = ckpt.save_checkpoint(tmp_path / "run", 2, model, opt, train_state={"state": {"step": 2},
                                ckpt_files.LORA_BASE: identity}, loader_state=None, dp_rank=0, write_loader_state=False,
                                adapters_only=True)
    saved = {k: v for k, v in load_plain_tensors(str(path)).items() if not k.startswith("optimizer")}
    assert saved and all(".lora_" in k for k in saved), sorted(saved)                   # no base weight stored
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in adapters)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)

    recorded = ckpt_files.load_train_state(path)[ckpt_files.LORA_BASE]
    fresh = _lora_model(2, check_lora_base(recorded, None, path))    # base from the recorded path, identity checked
    fresh_opt = megatron_optimizer(fresh, OptimizerConfig(lr=1e-2))
    ckpt.load_model_and_optimizer(path, fresh, fresh_opt, adapters_only=True)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        if a.requires_grad:
            assert torch.equal(adam_state(opt, a)["exp_avg_sq"], adam_state(fresh_opt, b)["exp_avg_sq"])
    _logits_step(model, opt, 3)
    _logits_step(fresh, fresh_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))   # next step bit-identical

    copy = tmp_path / "moved"                     # a copy without the stored fingerprint is hashed again: same identity
    shutil.copytree(base_dir, copy)
    (copy / FINGERPRINT_FILE).unlink()
    assert check_lora_base(recorded, copy, path) == copy
    other = save_megatron_checkpoint(tiny_model(5), TINY, tmp_path / "other")
    with pytest.raises(BaseMismatchError, match=f"{base_dir.resolve()} .*{other.resolve()}, has fingerprint"):
        check_lora_base(recorded, other, path)
    with pytest.raises(BaseMismatchError, match="does not exist"):
        check_lora_base(recorded, tmp_path / "gone", path)
    hf = tmp_path / "hf"                          # the HF folder the base was imported from: was "a different model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(BaseMismatchError, match=f"but {hf} is not an imported checkpoint \\(no model_config.json\\)"):
        check_lora_base(recorded, hf, path)
    # another model's weight files copied over the base keep every size (same shapes) and the stored fingerprint
    # file: their modification times differ, so they are hashed again (before: the stored fingerprint was trusted)
    swapped = tmp_path / "swapped"
    shutil.copytree(base_dir, swapped)
    for f in other.glob("__*.distcp"):
        shutil.copyfile(f, swapped / f.name)
    assert sorted(p.stat().st_size for p in swapped.glob("__*.distcp")) == \
        sorted(p.stat().st_size for p in base_dir.glob("__*.distcp"))
    with pytest.raises(BaseMismatchError, match="has fingerprint"):
        check_lora_base(recorded, swapped, path)


def test_two_imports_of_one_model_have_one_base_identity(tmp_path, parallel_state_1proc):  # noqa: F811
    """torch's ``.metadata`` index holds a random save id and the temp path it was written at: the base fingerprint
    hashed it, so a base re-imported from the same weights was "a different model" to its LoRA checkpoints."""
    import hashlib

    from packsft.train.model_checkpoint import (
        FINGERPRINT_FILE,
        BaseMismatchError,
        base_identity,
        check_lora_base,
        save_megatron_checkpoint,
    )

    a = save_megatron_checkpoint(tiny_model(0), TINY, tmp_path / "a")
    b = save_megatron_checkpoint(tiny_model(0), TINY, tmp_path / "b")
    assert (a / ".metadata").read_bytes() != (b / ".metadata").read_bytes()
    assert base_identity(a)["fingerprint"] == base_identity(b)["fingerprint"]
    check_lora_base(base_identity(a), b, "run")
    (b / FINGERPRINT_FILE).unlink()  # hashed again from the files: the same
    assert base_identity(b)["fingerprint"] == base_identity(a)["fingerprint"]
    # a LoRA checkpoint of an earlier packsft recorded the fingerprint over every file, .metadata included
    lines = "".join(f"{p.name} {p.stat().st_size} {hashlib.blake2b(p.read_bytes(), digest_size=20).hexdigest()}\n"
                    for p in sorted(a.iterdir()) if p.name not in ("model_config.json", "hf_config.json",
                                                                   FINGERPRINT_FILE))
    legacy = {"path": str(a), "fingerprint": hashlib.blake2b(lines.encode(), digest_size=16).hexdigest()}
    assert check_lora_base(legacy, a, "run") == a
    with pytest.raises(BaseMismatchError, match="a different model"):  # its own .metadata: not b's
        check_lora_base(legacy, b, "run")
    other = save_megatron_checkpoint(tiny_model(1), TINY, tmp_path / "other")
    with pytest.raises(BaseMismatchError, match="a different model"):
        check_lora_base(base_identity(a), other, "run")


def test_a_bf16_import_starts_an_fp32_run(tmp_path, parallel_state_1proc):  # noqa: F811
    """``import --params-dtype bfloat16`` wrote params_dtype bfloat16, which init_from then imposed (a run in bf16
    parameters): params_dtype may differ, the weights are cast on load."""
    import dataclasses

    from packsft.train.compat import check_init_model, load_train_config
    from packsft.train.model_checkpoint import load_megatron_checkpoint, save_megatron_checkpoint

    bf16 = dataclasses.replace(TINY, params_dtype="bfloat16")
    torch.manual_seed(0)
    source = build_gpt_model(bf16)
    base = save_megatron_checkpoint(source, bf16, tmp_path / "base")
    fp32 = build_gpt_model(TINY)
    load_megatron_checkpoint(fp32, base)
    for (name, a), b in zip(source.state_dict().items(), fp32.state_dict().values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert b.dtype == torch.float32 and torch.equal(a.float(), b), name
    run = ["data.train_path=x", "data.tokenizer=t", "data.max_seq_len=32", "train.train_steps=2",
           "train.global_batch_size=1", f"checkpoint.init_from={base}"]
    assert load_train_config(None, run).model.params_dtype == "bfloat16"  # the import's, unless set
    cfg = load_train_config(None, [*run, "model.params_dtype=float32"])   # refused before
    assert cfg.model.params_dtype == "float32"
    with pytest.raises(ValueError, match=r"model.hidden_size \(64\) differs"):  # a weight's shape still may not
        check_init_model(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=64)),
                         dataclasses.asdict(bf16))


def test_auto_resume_without_latest_takes_the_newest_complete_checkpoint(tmp_path):
    for step in (2, 10):
        (tmp_path / f"iter_{step:07d}").mkdir()
        (tmp_path / f"iter_{step:07d}" / ckpt_files.TRAIN_STATE).write_text("{}")
    (tmp_path / "iter_0000012").mkdir()                       # no train_state.json: not complete
    (tmp_path / "iter_0000014.tmp").mkdir()                   # a killed save
    assert ckpt_files.find_resume_checkpoint(tmp_path, "auto") == tmp_path / "iter_0000010"
    assert ckpt_files.complete_checkpoints(tmp_path) == [tmp_path / "iter_0000002", tmp_path / "iter_0000010"]
    with pytest.raises(ckpt_files.CheckpointDirError, match=r"holds iter_0000002, iter_0000010"):
        ckpt_files.check_fresh_start("none", tmp_path / "run", tmp_path)   # starting over would overwrite them


@pytest.mark.parametrize("make, shown", [
    (lambda p: p.mkdir(), "is not a file"),                                # the run was lost, then a traceback
    (lambda p: p.write_bytes(b"\xff\xfe"), "cannot be read as text"),       # an error naming no file
    (lambda p: p.write_text(""), "holds ''"),                              # named the folder itself
    (lambda p: p.write_text("../../other/checkpoints/iter_0000008\n"), "holds '../../other/"),  # another run's
    (lambda p: p.symlink_to(p.parent / "gone"), "is not a file"),          # taken as no latest
])
def test_latest_that_does_not_name_a_checkpoint_folder_is_refused(tmp_path, make, shown):
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / ckpt_files.TRAIN_STATE).write_text("{}")
    make(tmp_path / "latest")
    with pytest.raises(ckpt.CheckpointError, match=rf"latest should be a file naming the newest checkpoint .*but "
                                                   rf"{re.escape(shown)}"):
        ckpt_files.find_resume_checkpoint(tmp_path, "auto")


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["state"].pop("step"), "state.step is missing"),
    (lambda d: d["state"].update(step="a"), 'state.step is "a"'),
    (lambda d: d["state"].update(step=-5), "state.step is -5"),
    (lambda d: d["state"].update(consumed_samples=-4), "state.consumed_samples is -4"),
    (lambda d: d["state"].update(trained_tokens=True), "state.trained_tokens is true"),
    (lambda d: d.pop("scheduler"), "scheduler is missing"),
    (lambda d: d["scheduler"].update(last_epoch=2.5), "scheduler.last_epoch is 2.5"),
    (lambda d: d["state"].pop("consumed_samples"), "state.consumed_samples is missing"),   # restarted at 0
    (lambda d: d["state"].update(step=1), "state.step is 1 in the checkpoint of step 2"),  # resumed as step 1
    (lambda d: d.update(layout="x"), 'layout is "x", not an object'),                     # a traceback
    (lambda d: d["state"].update(source_trained_tokens={"a": 1.5}), "state.source_trained_tokens.a is 1.5"),
    (lambda d: d["state"].update(source_trained_tokens=[3]), r"state.source_trained_tokens is \[3\]"),
])
def test_resume_state_with_a_wrong_counter_is_refused(tmp_path, edit, field):
    saved = {"state": {"step": 2, "consumed_samples": 4, "trained_tokens": 9}, "scheduler": {"last_epoch": 2}}
    counters = ("step", "consumed_samples", "trained_tokens", "skipped_steps")
    path = tmp_path / "iter_0000002"
    ckpt_files.check_resume_state(saved, path, counters)
    edit(saved)
    with pytest.raises(ckpt.CheckpointError, match=rf"train_state.json: not a packsft train state \({field}"):
        ckpt_files.check_resume_state(saved, path, counters)


@pytest.mark.parametrize("name, content", [("common.pt", b"garbage\n"), ("common.pt", b""), ("common.pt", "half"),
                                           ("common.pt", None), ("metadata.json", b"{oops"),
                                           ("metadata.json", b'{"\xdd": 1}'), ("metadata.json", None),
                                           ("metadata.json", b"[1, 2]"), ("metadata.json", b'{"foo": 1}'),
                                           ("common.pt", "list")])
def test_damaged_common_file_is_a_checkpoint_error(tmp_path, parallel_state_1proc, name, content):  # noqa: F811
    """Was a traceback (``UnpicklingError``, exit 1), or for metadata.json an error line naming no file."""
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={"state": {"step": 1}},
                                loader_state={"sampler_state": {}}, dp_rank=0, write_loader_state=True)
    file = path / name
    if content is None:                 # a folder in its place: IsADirectoryError traceback
        file.unlink()
        file.mkdir()
    elif content == "list":             # loads, other contents: megatron's message naming no file
        torch.save([1, 2], file)
    else:                               # "half": truncated, RuntimeError traceback; \xdd: an error naming no file
        file.write_bytes(file.read_bytes()[:file.stat().st_size // 2] if content == "half" else content)
    with pytest.raises(ckpt.CheckpointError, match=rf"iter_0000001: {name} cannot be loaded .*damaged"):
        ckpt.load_model_and_optimizer(path, model, opt)


@pytest.mark.parametrize("name", ["rng_rank0.pt", "dataloader_dp0.pt"])
def test_damaged_state_files_are_named_as_damaged(tmp_path, parallel_state_1proc, name):  # noqa: F811
    """Random bytes were "refused: ... could run code ... altered or not written by packsft"; a folder in place of
    the RNG file was "missing"."""
    model = tiny_model(0)
    opt = megatron_optimizer(model, OptimizerConfig())
    path = ckpt.save_checkpoint(tmp_path, 1, model, opt, train_state={"state": {"step": 1}},
                                loader_state={"sampler_state": {}}, dp_rank=0, write_loader_state=True)
    load = (lambda: ckpt.load_rng_state(path, 0, required=True)) if name.startswith("rng") else \
        (lambda: ckpt.load_loader_state(path, 0))
    (path / name).write_bytes(bytes(range(7, 250)) * 4)
    with pytest.raises(ckpt.CheckpointError, match=rf"{name}: unreadable \(not a file torch.load reads"):
        load()
    (path / name).unlink()
    (path / name).mkdir()
    with pytest.raises(ckpt.CheckpointError, match=rf"{name}: not a file; the checkpoint is damaged"):
        load()

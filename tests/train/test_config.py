"""Training config: every YAML in configs/ loads; overrides apply; errors name the key and the values."""

from pathlib import Path

import pytest
import torch
import yaml

from packsft.train.config import check_parallel_layout, config_to_yaml, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"tiny_cpu.yaml", "smollm2_135m.yaml", "llama3_8b_multigpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_round_trips(path):
    cfg = load_config(path)
    assert cfg.loader.micro_batch_size == 1 and cfg.model.vocab_size > 0
    assert cfg.data.max_seq_len <= cfg.model.max_position_embeddings
    assert "tensor_model_parallel_size" in config_to_yaml(cfg)
    assert load_config(None, _dotlist(cfg)) == cfg          # overrides alone rebuild the same config


def _dotlist(cfg) -> list[str]:
    from omegaconf import OmegaConf

    def items(tree: dict, prefix: str = ""):      # nested sections too (data.energon)
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from items(value, f"{prefix}{key}.")
            elif value is not None or prefix:     # a section set to null (vision: null) is the default
                yield f"{prefix}{key}", value

    flat = OmegaConf.to_container(OmegaConf.structured(cfg))
    return [f"{key}={'null' if value is None else value}" for key, value in items(flat)]


def test_missing_required_values_are_named():
    with pytest.raises(ValueError, match="missing mandatory value: model"):
        load_config(None)
    with pytest.raises(ValueError, match="data.train_path"):
        load_config(None, [item for item in _dotlist(load_config(TINY)) if not item.startswith("data.train_path=")])


def test_overrides_apply_after_the_file():
    cfg = load_config(TINY, ["optimizer.lr=0.5", "train.train_steps=7", "loss.fused_linear_cross_entropy=false"])
    assert (cfg.optimizer.lr, cfg.train.train_steps, cfg.loss.fused_linear_cross_entropy) == (0.5, 7, False)
    assert load_config(TINY).loss.normalization == "token"
    assert load_config(TINY, ["loss.normalization=conversation"]).loss.normalization == "conversation"


@pytest.mark.parametrize("overrides, message", [
    (["parallel.context_parallel_size=3", "data.max_seq_len=100"], "2 * parallel.context_parallel_size (6)"),
    (["optimizer.lrr=1"], "optimizer.lrr: Key 'lrr' not in 'OptimizerConfig'"),
    (["optimizer.lr=abc"], "optimizer.lr: Value 'abc' of type 'str' could not be converted to Float"),
    (["optimizer.lr=0"], "optimizer.lr must be > 0"),
    (["model.num_layers=0"], "model.num_layers"),
    (["scheduler.decay_style=exp"], "scheduler.decay_style"),
    (["loss.normalization=sample"], "loss.normalization must be one of ('token', 'conversation'), got 'sample'"),
    (["data.prompt_format=chat-templat"], "data.prompt_format must be one of ('identity', "),   # named the key not
    (["scheduler.warmup_steps=1000", "train.train_steps=10"], "scheduler.warmup_steps (1000)"),
    (["data.split_validation_size=0", "validation.val_period=5"], "no validation data"),
    (["data.split_validation_size=1.5"], "data.split_validation_size must be in [0, 1)"),
    (["data.validation_path=v.packed"], "either data.validation_path or data.split_validation_size"),
    (["data.max_seq_len=999999"], "model.max_position_embeddings"),
    (["train.stop_at_step=99", "train.train_steps=10"], "train.stop_at_step (99)"),
    # non-finite numbers passed the comparisons (lr=inf trained NaN steps, clip_grad=nan turned clipping off)
    (["optimizer.lr=inf"], "optimizer.lr must be a finite number, got inf"),
    (["optimizer.lr=nan"], "optimizer.lr must be a finite number, got nan"),
    (["optimizer.weight_decay=nan"], "optimizer.weight_decay must be a finite number"),
    (["optimizer.clip_grad=nan"], "optimizer.clip_grad must be a finite number"),
    (["optimizer.adam_eps=nan"], "optimizer.adam_eps must be a finite number"),
    (["scheduler.min_lr=nan"], "scheduler.min_lr must be a finite number"),
    (["model.init_method_std=inf"], "model.init_method_std must be a finite number > 0, got inf"),
    (["model.rope_scaling_factor=inf"], "model.rope_scaling_factor must be a finite number > 0 or None"),
    (["model.rope_interpolation_factor=inf"], "model.rope_interpolation_factor must be a finite number > 0"),
    (["lora.enabled=true", "lora.alpha=inf"], "lora.alpha must be a finite number > 0, got inf"),
    (["scheduler.min_lr=1.0", "optimizer.lr=0.003"], "scheduler.min_lr (1.0) must be <= optimizer.lr (0.003)"),
    (["data.samples_per_epoch=5"], "data.samples_per_epoch (5) sets the epoch of a mixture"),  # it was ignored
    (["data.mixture_unit=tokens"], "data.mixture_unit must be one of ('rows', 'trained_tokens'), got 'tokens'"),
    (["data.mixture_unit=trained_tokens"], "data.mixture_unit (trained_tokens) sets what the weights of a mixture"),
    (["loader.seed=-1"], "loader.seed must be in [0, 2**63), got -1"),   # numpy's traceback at the first batch before
    (["train.seed=18446744073709551616"], "train.seed must be in [0, 2**63), got 18446744073709551616"),  # overflow
    (["train.seed=-1"], "train.seed must be in [0, 2**63), got -1"),
    (["train.train_steps"], "override 'train.train_steps' is not key=value"),   # was "Incompatible value 'None'"
])
def test_config_errors_are_clear(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(TINY, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)  # one line (OmegaConf's ran over four)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_nccl_without_cuda_is_refused_by_name():
    from packsft.train.distributed import init_distributed

    with pytest.raises(ValueError, match=r"^parallel.backend=nccl needs CUDA GPUs .* no CUDA device: use gloo"):
        init_distributed(backend="nccl")   # before any process group: torch's RuntimeError traceback before


@pytest.mark.parametrize(("text", "message"), [
    ("- a\n", "the file must be a mapping of sections (model:, data:, train:, ...), not a list"),  # was "Index
    # 'loader' (str) is not an int"; below: a hint about overrides the run did not give
    ("data:\n  train:\n    path: x\n", "a mapping where a list is expected: data.train and data.validation are lists"),
])
def test_a_file_of_the_wrong_shape_is_named(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(tmp_path / "c.yaml")
    assert str(err.value).startswith(f"invalid config {tmp_path / 'c.yaml'}: ") and message in str(err.value)


def test_a_read_only_output_dir_is_one_line_naming_it(tmp_path, monkeypatch):
    """Checked first at start (it was an OSError traceback where a file was first written in it)."""
    import errno
    import os
    import tempfile

    from packsft.train.loop import Trainer

    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o555)
    if os.access(out, os.W_OK):       # root writes anyway: give it the refusal everyone else gets
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ValueError) as err:
        Trainer(load_config(TINY, [f"logging.output_dir={out}"]))
    assert str(err.value) == (f"logging.output_dir {out} is not writable (Permission denied); set logging.output_dir "
                              "to a writable folder")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"logging.output_dir {tmp_path}/file/run is not writable \\({tmp_path}/file "
                                         "is a file, not a folder\\)"):
        Trainer(load_config(TINY, [f"logging.output_dir={tmp_path / 'file' / 'run'}"]))


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config("nope.yaml")


def test_parallel_layout_against_world_size():
    assert check_parallel_layout(load_config(TINY, ["train.global_batch_size=8"]), 4) == 4
    big = load_config(CONFIGS[0].parent / "llama3_8b_multigpu.yaml")  # TP=4, CP=2
    assert check_parallel_layout(big, 16) == 2
    tiny = load_config(TINY, ["train.global_batch_size=3"])
    with pytest.raises(ValueError, match=r"train.global_batch_size \(3\) must be a multiple of .* data-parallel size"):
        check_parallel_layout(tiny, 2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE \(12\) must be a multiple"):
        check_parallel_layout(big, 12)


@pytest.mark.parametrize("old, new, value", [
    ("loader.dataloader_num_workers", "loader.num_workers", 3),
    ("loader.dataloader_persistent_workers", "loader.persistent_workers", True),
    ("data.override_pad_token", "data.pad_token", "<pad>"),
])
def test_old_key_names_still_load_with_a_warning(tmp_path, old, new, value):
    section, old_key = old.split(".")
    new_key = new.split(".")[1]
    with pytest.warns(FutureWarning, match=f"{old} is renamed {new}"):
        assert getattr(getattr(load_config(TINY, [f"{old}={value}"]), section), new_key) == value
    old_yaml = yaml.safe_load(TINY.read_text())
    old_yaml.setdefault(section, {})[old_key] = value
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old_yaml))
    with pytest.warns(FutureWarning, match=old):
        assert getattr(getattr(load_config(tmp_path / "old.yaml"), section), new_key) == value
    with pytest.raises(ValueError, match="sets both"):
        load_config(TINY, [f"{old}={value}", f"{new}={value}"])


def test_sequence_parallel_needs_tp_and_a_row_that_splits():
    with pytest.warns(UserWarning, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        assert not load_config(TINY, ["parallel.sequence_parallel=true"]).parallel.sequence_parallel
    cfg = load_config(TINY, ["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"])
    assert cfg.parallel.sequence_parallel and cfg.parallel.sequence_parallel_size == 2
    with pytest.raises(ValueError, match="lcm"):
        load_config(TINY, ["parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=8",
                           "data.max_seq_len=1028", "model.max_position_embeddings=2048"])


def test_lora_demo_config_loads():
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "smollm2_135m_lora_cpu.yaml")
    assert cfg.lora.enabled and cfg.lora.rank == 16 and cfg.lora.scaling == 2.0
    assert cfg.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert cfg.model.hidden_size == 576 and cfg.logging.output_dir == "out/demo/lora"
    with pytest.raises(ValueError, match="lora.rank"):
        load_config(Path(__file__).resolve().parents[2] / "configs" / "smollm2_135m_lora_cpu.yaml", ["lora.rank=0"])


def test_a_checkpoint_refuses_another_architecture():
    from packsft.train.checkpoint import CheckpointError
    from packsft.train.compat import check_recorded_architecture, recorded_architecture

    cfg = load_config(TINY, ["lora.enabled=true", "lora.alpha=16"])
    recorded = recorded_architecture({"config": config_to_yaml(cfg)}, "ck")
    check_recorded_architecture(cfg.model, cfg.lora, recorded, "ck", fix="FIX")
    free = load_config(TINY, ["lora.enabled=true", "lora.dropout=0.1", "model.init_method_std=0.01",
                              "model.recompute_granularity=selective"])
    check_recorded_architecture(free.model, free.lora, recorded, "ck", fix="FIX")     # no weight depends on them
    modules = list(reversed(cfg.lora.target_modules))
    reordered = load_config(TINY, ["lora.enabled=true", f"lora.target_modules={modules}"])
    check_recorded_architecture(reordered.model, reordered.lora, recorded, "ck", fix="FIX")   # the same set
    plain = recorded_architecture({"config": config_to_yaml(load_config(TINY))}, "ck")
    check_recorded_architecture(load_config(TINY, ["lora.alpha=32"]).model, None, plain, "ck",
                                fix="FIX")      # LoRA off on both sides: lora.* not compared
    for override, message in (("model.rotary_base=10000", r"model.rotary_base is 10000.0 but checkpoint ck was "
                                                          r"trained with 100000.0; FIX model.rotary_base=100000.0$"),
                              ("model.num_layers=3", "model.num_layers is 3 but"),
                              ("lora.alpha=32", "lora.alpha is 32.0 but checkpoint ck was trained with 16.0"),
                              ("lora.enabled=false", "lora.enabled is False but checkpoint ck was trained with True")):
        other = load_config(TINY, ["lora.enabled=true", "lora.alpha=16", override])
        with pytest.raises(CheckpointError, match=message):
            check_recorded_architecture(other.model, other.lora if other.lora.enabled else None, recorded, "ck",
                                        fix="FIX {key}={value}")
    with pytest.raises(CheckpointError, match="records no config with a model section"):
        recorded_architecture({}, "ck")


def test_a_checkpoint_refuses_another_optimizer_state_format():
    """optimizer.backend and use_distributed_optimizer set the optimizer state's format: a resume keeps them; a
    checkpoint of the removed torch backend is refused with the way on."""
    from packsft.train.checkpoint import CheckpointError
    from packsft.train.compat import check_recorded_optimizer, recorded_architecture

    megatron = ["optimizer.backend=megatron", "optimizer.use_distributed_optimizer=true"]
    recorded = recorded_architecture({"config": config_to_yaml(load_config(TINY, megatron))}, "ck")
    check_recorded_optimizer(load_config(TINY, [*megatron, "optimizer.lr=0.1"]).optimizer, recorded, "ck")
    with pytest.raises(CheckpointError, match="optimizer.use_distributed_optimizer is False but checkpoint ck was "
                       "trained with True.* resume with optimizer.use_distributed_optimizer=true"):
        check_recorded_optimizer(load_config(TINY, megatron[:1]).optimizer, recorded, "ck")
    with pytest.raises(CheckpointError, match="optimizer.backend is 'megatron' but checkpoint ck was trained with "
                       "'torch', .*packsft no longer has that backend: start a new run from its weights"):
        check_recorded_optimizer(load_config(TINY).optimizer, {"optimizer": {"backend": "torch"}}, "ck")
    with pytest.raises(ValueError, match="optimizer.backend must be 'megatron'.*got 'torch'"):
        load_config(TINY, ["optimizer.backend=torch"])
    check_recorded_optimizer(load_config(TINY).optimizer, {"optimizer": {}}, "ck")  # a config that predates them
    # the distributed optimizer's shards are cut for TP and PP: another size was Megatron's "Global shape mismatch"
    tp2 = recorded_architecture({"config": config_to_yaml(load_config(
        TINY, [*megatron, "parallel.tensor_model_parallel_size=2"]))}, "ck")
    now = load_config(TINY, megatron)
    with pytest.raises(CheckpointError, match=r"^parallel.tensor_model_parallel_size is 1 but checkpoint ck was "
                                              r"trained with 2, .*resume with parallel.tensor_model_parallel_size=2"):
        check_recorded_optimizer(now.optimizer, tp2, "ck", now.parallel)
    check_recorded_optimizer(now.optimizer, recorded, "ck", now.parallel)   # same TP and PP (any DP): resumes
    plain = load_config(TINY, megatron[:1])   # Megatron's optimizer without sharding: resharded on load
    check_recorded_optimizer(plain.optimizer, {**tp2, "optimizer": {"backend": "megatron"}}, "ck", plain.parallel)


def test_max_seq_len_that_does_not_split_over_cp_names_the_config_keys():
    with pytest.raises(ValueError, match=r"data.max_seq_len \(258\) must be a multiple of 2 \* "
                                         r"parallel.context_parallel_size \(4\)"):
        load_config(TINY, ["parallel.context_parallel_size=2", "data.max_seq_len=258"])

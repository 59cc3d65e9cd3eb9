"""A training step reads nothing back from the device, anywhere: packsft's, Megatron's and torch's code counted; a
logging step reads the documented few. A step whose loss is not finite is skipped on the device (no update) and
counted; too many in a row stop the run at the next logging step or checkpoint."""

import sys
import traceback
from pathlib import Path

import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_loop import packed, write_config  # noqa: F401 - fixture
from torch.overrides import TorchFunctionMode

from packsft.train.config import load_config
from packsft.train.grad_clip import torch_optimizers

TORCH = str(Path(torch.__file__).parent)
READS_BACK = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
              torch.Tensor.numpy}
# Megatron's RNG tracker fork (sequence parallelism) compares the CPU generator's state: a host tensor on CUDA too
HOST_TENSOR_READ = ("megatron/core/tensor_parallel/random.py", "cpu_rng_state == torch.get_rng_state()")
LOGGING_READS = 5                   # the counters' .tolist() and the result's loss, grad_norm, trained_tokens, skipped


class HostReads(TorchFunctionMode):
    """Records every tensor -> host read (a device sync on CUDA) made by any code (packsft, Megatron, torch) while
    active, each named by the first calling line outside torch's own package."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS_BACK and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            frames = traceback.extract_stack(sys._getframe(1), limit=12)[::-1]
            caller = next((f for f in frames if not f.filename.startswith(TORCH)), frames[0])
            if caller.filename.endswith(HOST_TENSOR_READ[0]) and HOST_TENSOR_READ[1] in (caller.line or ""):
                return func(*args, **(kwargs or {}))
            self.calls.append(f"{Path(caller.filename).name}:{caller.lineno} {caller.line}")
        return func(*args, **(kwargs or {}))


def trainer_for(tmp_path, packed, **sections):  # noqa: F811
    from packsft.train.loop import Trainer

    cfg = load_config(write_config(tmp_path / "c.yaml", packed, tmp_path / "o", checkpoint={"resume": "none"},
                                   **sections))
    return Trainer(cfg)


OPTIMIZERS = {"megatron": {}, "megatron_dist_opt": {"use_distributed_optimizer": True}}


def _count_reads_of_steps(trainer, out_dir):
    """Host reads of one non-logging and one logging step, after two warm-up steps (lazy state, first calls)."""
    from packsft.train.metrics import MetricsLogger

    logger = MetricsLogger(str(out_dir), enabled=True, tensorboard=False, progress=False, initial_step=0,
                           total_steps=100)
    trainer.meter.last_step, trainer.meter.log_interval = 100, 4
    counts, draw = [], trainer.next_micro_batches
    for _ in range(4):
        batches = draw()                               # the loader reads host tensors: not counted
        trainer.next_micro_batches = lambda batches=batches: batches
        with HostReads() as reads:
            trainer._one_step(logger)                  # steps 1-3 do not log, step 4 does
        counts.append(reads.calls)
    return counts[2], counts[3]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_step_reads_nothing_back(tmp_path, packed, parallel_state_1proc, fused,  # noqa: F811
                                                  optimizer):
    trainer = trainer_for(tmp_path, packed, loss={"fused_linear_cross_entropy": fused},
                          optimizer={"lr": 3e-3, "weight_decay": 0.0, **OPTIMIZERS[optimizer]})
    quiet, logging = _count_reads_of_steps(trainer, tmp_path / "o")
    assert quiet == [], quiet
    assert len(logging) == LOGGING_READS, logging
    result = trainer.step_tensors(trainer.next_micro_batches())
    assert all(torch.is_tensor(result[k]) for k in ("loss", "grad_norm", "trained_tokens"))


def test_a_conversation_normalized_step_reads_nothing_back(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    """``loss.normalization: conversation`` adds a count and weights to the step, never a host read."""
    trainer = trainer_for(tmp_path, packed, loss={"normalization": "conversation"},
                          optimizer={"lr": 3e-3, "weight_decay": 0.0})
    quiet, logging = _count_reads_of_steps(trainer, tmp_path / "o")
    assert quiet == [], quiet
    assert len(logging) == LOGGING_READS, logging


def _layouts_reads_worker(rank, world_size, config_path, layouts):
    """Host reads of a quiet and a logging step on this rank, for each layout (dotted overrides) in turn."""
    from megatron.core import parallel_state

    from packsft.train.loop import Trainer

    results = []
    for overrides in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        trainer = Trainer(load_config(config_path, list(overrides)))
        results.append(_count_reads_of_steps(trainer, trainer.cfg.logging.output_dir))
        torch.distributed.barrier()
    return results


@pytest.mark.distributed
@pytest.mark.slow
def test_tp_cp_pp_steps_read_nothing_back(tmp_path, packed):  # noqa: F811
    """2 gloo processes, Megatron optimizer: TP 2 with sequence parallelism, CP 2 (distributed optimizer; through the
    CP attention and RoPE paths), PP 2 (the pipeline schedule): every rank reads nothing on a step, 5 values on a
    logging step."""
    from distributed_helpers import run_distributed
    from test_loop import SEQ

    from packsft.packing.config import PackConfig
    from packsft.packing.pipeline import run_pack

    cp2 = tmp_path / "cp2.jsonl.packed"
    run_pack(PackConfig(inputs=[str(packed["few"])[:-len(".packed")]], output=str(cp2), max_seq_len=SEQ,
                        context_parallel_size=2, tokenizer=str(packed["tokenizer"]), histogram="", progress=False))
    config = write_config(tmp_path / "c.yaml", packed, tmp_path / "o", checkpoint={"resume": "none"},
                          optimizer={"lr": 3e-3, "weight_decay": 0.0})
    layouts = [("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"),
               ("parallel.context_parallel_size=2", f"data.train_path={cp2}",
                "optimizer.use_distributed_optimizer=true"),
               ("parallel.pipeline_model_parallel_size=2",)]
    layouts = [(*layout, f"logging.output_dir={tmp_path / f'o{i}'}") for i, layout in enumerate(layouts)]
    for rank, per_layout in enumerate(run_distributed(_layouts_reads_worker, 2, str(config), layouts,
                                                      timeout_s=400)):
        for layout, (quiet, logging) in zip(layouts, per_layout):
            assert quiet == [], (rank, layout, quiet)
            assert len(logging) == LOGGING_READS, (rank, layout, logging)


@pytest.mark.parametrize("optimizer", [{}, {"use_distributed_optimizer": True}], ids=["megatron", "megatron_dist_opt"])
def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, packed, parallel_state_1proc,  # noqa: F811
                                                               optimizer):
    trainer = trainer_for(tmp_path, packed, train={"global_batch_size": 2, "train_steps": 4, "max_skipped_steps": 1},
                          optimizer={"lr": 3e-3, "weight_decay": 0.0, **optimizer})
    before = {n: p.detach().clone() for n, p in trainer.gpt.named_parameters()}
    original = trainer.schedule.token_losses
    trainer.schedule.token_losses = lambda model, batch: original(model, batch) * float("nan")
    result = trainer.train_step(trainer.next_micro_batches())
    assert result["skipped"] and trainer.scheduler.last_epoch == 1          # the schedule follows the step number
    assert all(torch.equal(p, before[n]) for n, p in trainer.gpt.named_parameters())
    states = [s for opt in torch_optimizers(trainer.optimizer) for s in opt.state.values()]
    assert states and all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in states)   # Adam untouched
    trainer.schedule.token_losses = original
    assert not trainer.train_step(trainer.next_micro_batches())["skipped"]
    assert any(not torch.equal(p, before[n]) for n, p in trainer.gpt.named_parameters())
    trainer.schedule.token_losses = lambda model, batch: original(model, batch) * float("inf")
    from packsft.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path / "o"), enabled=True, tensorboard=False, progress=False, initial_step=0,
                           total_steps=4)
    trainer._last_step, trainer.cfg.logging.log_interval = 10, 1
    trainer._one_step(logger)                                      # 1 skipped: allowed
    assert trainer.state.skipped_steps == 1
    with pytest.raises(FloatingPointError, match="step 2: .* not finite for 2 steps in a row"):
        trainer._one_step(logger)


def test_too_many_skipped_steps_stop_the_run_at_the_next_sync(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    """Between logging steps nothing is read: the run of skipped steps is counted on the device and the limit is
    applied at the next logging step (or checkpoint), naming the longest run."""
    trainer = trainer_for(tmp_path, packed, train={"global_batch_size": 2, "train_steps": 10, "max_skipped_steps": 1})
    from packsft.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path / "o"), enabled=True, tensorboard=False, progress=False, initial_step=0,
                           total_steps=10)
    trainer.meter.last_step, trainer.meter.log_interval = 10, 4
    original = trainer.schedule.token_losses
    trainer.schedule.token_losses = lambda model, batch: original(model, batch) * float("nan")
    for _ in range(3):
        trainer._one_step(logger)                                  # steps 1-3 skipped, not yet read
    assert trainer.state.skipped_steps == 0
    trainer.schedule.token_losses = original
    with pytest.raises(FloatingPointError, match="step 4: .* not finite for 3 steps in a row"):
        trainer._one_step(logger)


def test_a_run_that_raises_leaves_no_sigterm_handler_behind(tmp_path, packed, parallel_state_1proc):  # noqa: F811
    """The stop-on-SIGTERM handler of ``Trainer.run`` is removed however the run ends (a process forked later, e.g.
    a packer, would otherwise inherit it)."""
    import signal

    trainer = trainer_for(tmp_path, packed, train={"global_batch_size": 2, "train_steps": 4})

    def fails(logger):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # installed while the run runs
        raise FloatingPointError("step failed")

    trainer._one_step = fails
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(FloatingPointError, match="step failed"):
        trainer.run()
    assert signal.getsignal(signal.SIGTERM) is before

"""The training step reads nothing back from the device in packsft's own code but the skip decision, and a step
whose loss is not finite is skipped (no update) and counted; too many in a row stop the run."""

import sys
import traceback
from pathlib import Path

import pytest
import torch
from distributed_helpers import parallel_state_1proc  # noqa: F401 - fixture
from test_train_loop import packed, write_config  # noqa: F401 - fixture
from torch.overrides import TorchFunctionMode

from packsft.train.config import load_config

PACKAGE = str(Path(__file__).resolve().parents[1] / "packsft")
READS_BACK = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero}


class HostReads(TorchFunctionMode):
    """Records every tensor -> host read (a device sync on CUDA) made directly by packsft code."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS_BACK and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            caller = traceback.extract_stack(sys._getframe(1), limit=1)[0]
            if caller.filename.startswith(PACKAGE):
                self.calls.append(f"{Path(caller.filename).name}:{caller.lineno} {caller.line}")
        return func(*args, **(kwargs or {}))


def trainer_for(tmp_path, packed, **sections):  # noqa: F811
    from packsft.train.loop import Trainer

    cfg = load_config(write_config(tmp_path / "c.yaml", packed, tmp_path / "o", checkpoint={"resume": "none"},
                                   **sections))
    return Trainer(cfg)


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_reads_back_only_the_skip_decision(tmp_path, packed, parallel_state_1proc, fused):  # noqa: F811
    trainer = trainer_for(tmp_path, packed, loss={"fused_linear_cross_entropy": fused})
    batches = trainer.next_micro_batches()
    trainer.step_tensors(batches)                                   # warm-up (lazy state, first-call checks)
    batches = trainer.next_micro_batches()
    with HostReads() as reads:
        result = trainer.step_tensors(batches)
    assert len(reads.calls) == 1 and "isfinite" in reads.calls[0], reads.calls
    assert all(torch.is_tensor(result[k]) for k in ("loss", "grad_norm", "trained_tokens"))


@pytest.mark.parametrize("optimizer", [{}, {"backend": "megatron", "use_distributed_optimizer": True}],
                         ids=["torch", "megatron_dist_opt"])
def test_non_finite_steps_are_skipped_counted_and_stop_the_run(tmp_path, packed, parallel_state_1proc,  # noqa: F811
                                                               optimizer):
    trainer = trainer_for(tmp_path, packed, train={"global_batch_size": 2, "train_steps": 4, "max_skipped_steps": 1},
                          optimizer={"lr": 3e-3, "weight_decay": 0.0, **optimizer})
    before = {n: p.detach().clone() for n, p in trainer.gpt.named_parameters()}
    original = trainer._token_loss
    trainer._token_loss = lambda batch: original(batch) * float("nan")
    result = trainer.train_step(trainer.next_micro_batches())
    assert result["skipped"] and trainer.scheduler.last_epoch == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.gpt.named_parameters())
    trainer._token_loss = original
    assert not trainer.train_step(trainer.next_micro_batches())["skipped"]
    assert any(not torch.equal(p, before[n]) for n, p in trainer.gpt.named_parameters())
    trainer._token_loss = lambda batch: original(batch) * float("inf")
    from packsft.train.metrics import MetricsLogger

    logger = MetricsLogger(str(tmp_path / "o"), enabled=True, tensorboard=False, progress=False, initial_step=0,
                           total_steps=4)
    trainer._last_step = 4
    trainer._one_step(logger)                                      # 1 skipped: allowed
    assert trainer.state.skipped_steps == 1
    with pytest.raises(FloatingPointError, match="not finite for 2 steps in a row"):
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

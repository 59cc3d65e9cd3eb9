"""Megatron's DDP + distributed optimizer on CPU/gloo: step parity, state sharding,
checkpoint resume across DP sizes, and bf16 mixed precision.

Data and model: the 4 real packed rows and tiny model of ``test_parallel_checkpoint.py`` (hidden 64, 2 layers,
vocab 49152, fp32, ``train.global_batch_size`` 4 = every row, so each layout trains on the same global batch).
"""

import json

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import run_distributed
from test_parallel_checkpoint import NO_SAVE, _train, config  # noqa: F401 - fixture

from packsft.train.config import load_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MEGATRON = ("optimizer.backend=megatron",)
DIST_OPT = (*MEGATRON, "optimizer.use_distributed_optimizer=true")


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the Adam state tensors (``exp_avg``, ``exp_avg_sq``) this rank holds, summed.

    Those of the inner torch optimizers of Megatron's (this rank's shard with the distributed optimizer). In fp32
    the master weights are the model's parameters (or views of them), so the moments are the whole optimizer state.
    """
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    total = 0
    for opt in inner:
        for state in opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim())
    return total


def _one_step(rank, world_size, config_path, out_dir, variants):
    """For each override list: build the Trainer, run one step; return loss, norm, params after it, state bytes."""
    from megatron.core import parallel_state

    from packsft.train.loop import Trainer

    results = []
    for i, overrides in enumerate(variants):
        if i:
            parallel_state.destroy_model_parallel()
        cfg = load_config(config_path, [f"logging.output_dir={out_dir}/{i}", "checkpoint.resume=none",
                                        "loader.sampler=sequential", *overrides])
        trainer = Trainer(cfg)
        step = trainer.train_step(trainer.next_micro_batches())
        params = {n: p.detach().float().clone() for n, p in trainer.gpt.named_parameters()}
        results.append({"step": step, "params": params, "state_bytes": optimizer_state_bytes(trainer.optimizer),
                        "param_count": sum(p.numel() for p in params.values())})
        dist.barrier()
    return results


SEQUENCE_PARALLEL = (*DIST_OPT, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")


@pytest.fixture(scope="module")
def one_step(tmp_path_factory, config):  # noqa: F811
    """One step of each layout, read by the parity tests: ``ref`` (1 process, megatron), and per rank of one
    2-process spawn the distributed optimizer, the replicated megatron optimizer and TP=2 + SP (``_one_step``)."""
    out = tmp_path_factory.mktemp("one_step")
    (ref,) = run_distributed(_one_step, 1, str(config), str(out / "ref"), [MEGATRON])[0]
    two = run_distributed(_one_step, 2, str(config), str(out / "two"), [DIST_OPT, MEGATRON, SEQUENCE_PARALLEL])
    return ref, two


def test_distributed_optimizer_step_equals_single_process_and_shards_the_state(one_step):
    ref, per_rank = one_step
    two = [r[:2] for r in per_rank]
    worst = {}
    for dist_opt, replicated in two:
        for name, before in ref["params"].items():
            for label, run in (("dist_opt", dist_opt), ("megatron_dp2", replicated)):
                worst[label] = max(worst.get(label, 0.0), float((run["params"][name] - before).abs().max()))
        assert abs(dist_opt["step"]["loss"] - ref["step"]["loss"]) < 1e-6, (dist_opt["step"], ref["step"])
        for run in (dist_opt, replicated):   # Megatron's norm sums per-tensor (per-shard) norms
            assert abs(run["step"]["grad_norm"] / ref["step"]["grad_norm"] - 1) < 1e-4, (run, ref)
        assert dist_opt["step"]["trained_tokens"] == ref["step"]["trained_tokens"]
    shard = [r[0]["state_bytes"] for r in two]
    full = two[0][1]["state_bytes"]
    print("grad norms: dp1", ref["step"]["grad_norm"], "megatron dp2", two[0][1]["step"]["grad_norm"],
          "dist opt dp2", two[0][0]["step"]["grad_norm"])
    print("max |param diff| after one step vs 1 process:", worst,
          "| state bytes per rank: distributed", shard, "replicated", full, "ratio", [s / full for s in shard],
          "| 1 process", ref["state_bytes"], "| params", ref["param_count"])
    assert all(v < 1e-6 for v in worst.values()), worst
    assert full == ref["state_bytes"] == 8 * ref["param_count"]     # 2 fp32 moments per parameter
    assert all(abs(s / full - 0.5) < 0.01 for s in shard), (shard, full)
    assert abs(sum(shard) - full) <= 8 * 64 * 2, (shard, full)                     # only bucket padding differs


def test_sequence_parallel_with_the_distributed_optimizer_equals_single_process(one_step):
    """TP=2 + SP under Megatron DDP: ``finalize_model_grads`` must sum the norms' partial gradients over TP."""
    ref, two = one_step
    per_rank = [r[2] for r in two]
    norms = [n for n in ref["params"] if "layernorm" in n]
    assert norms
    for run in per_rank:
        assert abs(run["step"]["loss"] - ref["step"]["loss"]) < 1e-6, (run["step"], ref["step"])
        assert abs(run["step"]["grad_norm"] / ref["step"]["grad_norm"] - 1) < 1e-4, (run["step"], ref["step"])
        worst = max(float((run["params"][n] - ref["params"][n]).abs().max()) for n in norms)
        assert worst < 1e-6, worst                           # replicated norm weights after the update


def _losses(output_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_distributed_optimizer_checkpoint_resumes_at_dp1_and_dp2(tmp_path, config):  # noqa: F811
    three = ("train.train_steps=3",)
    full = _train(config, tmp_path / "full", 2, *DIST_OPT, *three)
    assert sorted(full) == [1, 2, 3] and abs(full[2] - full[1]) > 1e-2
    saved = tmp_path / "full" / "checkpoints" / "iter_0000001"
    dp2 = _train(config, tmp_path / "dp2", 2, *DIST_OPT, *three, f"checkpoint.resume={saved}", NO_SAVE)
    dp1 = _train(config, tmp_path / "dp1", 1, *DIST_OPT, *three, f"checkpoint.resume={saved}", NO_SAVE,
                 "checkpoint.restore_data_order=false")
    assert sorted(dp2) == sorted(dp1) == [2, 3]
    diffs = {name: {s: abs(run[s] - full[s]) for s in (2, 3)} for name, run in (("dp2", dp2), ("dp1", dp1))}
    print("uninterrupted", full, "resumed dp2", dp2, "resumed dp1", dp1, "diffs", diffs)
    assert dp2 == {2: full[2], 3: full[3]}, diffs                    # same layout: bit-exact
    assert all(d < 1e-5 for d in diffs["dp1"].values()), diffs


@pytest.mark.parametrize("dist_opt", [False, True], ids=["megatron", "megatron_dist_opt"])
def test_bf16_trains_with_finite_decreasing_loss(tmp_path, config, dist_opt):  # noqa: F811
    overrides = (*(DIST_OPT if dist_opt else MEGATRON), "train.bf16=true", "train.train_steps=6",
                 "checkpoint.save_interval=0", "checkpoint.save_at_end=true")
    losses = _train(config, tmp_path / "bf16", 2 if dist_opt else 1, *overrides)
    print("bf16 losses", losses)
    assert sorted(losses) == list(range(1, 7))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[6] < losses[1] - 0.5, losses
    assert (tmp_path / "bf16" / "checkpoints" / "iter_0000006").is_dir()

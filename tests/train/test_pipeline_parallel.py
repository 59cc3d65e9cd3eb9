"""Pipeline parallelism (Megatron-Core's 1F1B and interleaved schedules) equals the single-process step (fp32, gloo).

Data: the 4 real packed rows of ``test_parallel_parity.py`` (hh-rlhf, SmolLM2 tokenizer, 256-token rows of 4-5
conversations, packed for CP 4 and valid for CP 1 and 2). Model: that test's tiny model with 4 layers, tied
embeddings, ``optimizer.backend: megatron``, ``train.global_batch_size`` 4 = every row (4 micro-batches per step at
DP = 1). Every layout starts from the same full weights (the reference's, copied into each stage's layers by global
layer number and sliced for TP), runs one ``Trainer.train_step`` and returns its loss, trained-token count and every
parameter's reduced gradient (``main_grad``, TP shards gathered, keyed by the global parameter name), compared with the
one-process, no-pipeline step. ``optimizer.clip_grad`` 1e9 (inactive), so the gradients are the raw ones.

Spawns (each shared by the tests of its layouts): 2 processes (PP=2 fused and stock loss, PP=2 x VP=2 interleaved,
PP=2 with full recompute), 4 processes (PP=4, PP=2 x TP=2 with sequence parallelism, PP=2 x CP=2, then the
isolation check at PP=4), 2 processes for LoRA at PP=2; the stop/resume and resharding checks run
``tools/train.py`` (``tests/train/test_parallel_checkpoint.py``'s ``_train``).
"""

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import own_output_dir, parallel_state_1proc, run_distributed  # noqa: F401
from test_parallel_checkpoint import NO_SAVE, _train, config  # noqa: F401 - fixture
from test_parallel_parity import packed, setup  # noqa: F401 - fixtures

from packsft.train.config import OptimizerConfig, load_config

PP2, VP2 = "parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"
BASE = ("model.num_layers=4", "optimizer.backend=megatron", "optimizer.clip_grad=1e9")
TOL = 1e-6


def _global_name(gpt, name: str) -> str:
    """``decoder.layers.<local>.`` -> ``decoder.layers.<global>.``; a last stage's tied output weight -> embedding."""
    from packsft.model.gpt import global_layer_name

    if name == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return global_layer_name(gpt, name)


def _tp_shard(full: torch.Tensor, p, name: str, tp_group) -> torch.Tensor:
    """This TP rank's shard of the full tensor ``full`` (SwiGLU ``fc1``: ``[gate_r; up_r]``)."""
    tp = dist.get_world_size(tp_group)
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return full
    rank = dist.get_rank(tp_group)
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    return full.chunk(tp, dim=p.partition_dim)[rank]


def _tp_full(shard: torch.Tensor, p, name: str, tp_group) -> torch.Tensor:
    """The full tensor of a TP-sharded ``shard`` (inverse of :func:`_tp_shard`; collective over TP)."""
    tp = dist.get_world_size(tp_group)
    if tp == 1 or not getattr(p, "tensor_model_parallel", False):
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [part.chunk(2, dim=0) for part in parts]
        parts = [h[0] for h in halves] + [h[1] for h in halves]
    return torch.cat(parts, dim=p.partition_dim)


def load_full_weights(trainer, full: dict[str, torch.Tensor]) -> None:
    """Copy the one-process model's parameters ``full`` into every chunk of ``trainer`` (global layer names, TP)."""
    with torch.no_grad():
        for gpt in trainer.gpts:
            for name, p in gpt.named_parameters():
                p.copy_(_tp_shard(full[_global_name(gpt, name)], p, name, trainer.ctx.tp_group))


def full_grads(trainer) -> dict[str, torch.Tensor]:
    """This rank's reduced gradients (``main_grad``) as full tensors under their global (one-process) names."""
    grads = {}
    for gpt in trainer.gpts:
        for name, p in gpt.named_parameters():
            key = _global_name(gpt, name)
            grad = _tp_full(p.main_grad.detach().clone(), p, name, trainer.ctx.tp_group)
            grads[key if key not in grads else key + "#output"] = grad
    return grads


def _step(config_path: str, train_path: str, overrides: tuple[str, ...], full: dict | None) -> dict:
    from packsft.train.loop import Trainer

    cfg = load_config(config_path, [*BASE, own_output_dir(config_path), f"data.train_path={train_path}", *overrides])
    trainer = Trainer(cfg)
    if full is not None:
        load_full_weights(trainer, full)
    weights = {_global_name(g, n): p.detach().clone() for g in trainer.gpts for n, p in g.named_parameters()}
    result = trainer.train_step(trainer.next_micro_batches())
    return {"step": result, "grads": full_grads(trainer), "weights": weights, "layout": trainer.layout(),
            "recompute": [(g.config.recompute_granularity, g.config.recompute_method) for g in trainer.gpts],
            "stages": [(g.pre_process, g.post_process, [layer.layer_number - 1 for layer in g.decoder.layers])
                       for g in trainer.gpts]}


def _layouts_worker(rank, world_size, config_path, train_paths, layouts, full):
    from megatron.core import parallel_state

    results = []
    for cp, overrides in layouts:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        results.append(_step(config_path, train_paths[cp], overrides, full))
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def reference(setup, parallel_state_1proc):  # noqa: F811
    """The one-process megatron-backend step (no pipeline) and its initial weights."""
    config_path, paths = setup
    ref = _step(config_path, paths[1], (), None)
    assert ref["layout"]["pipeline_model_parallel_size"] == 1
    return ref


def _compare(name: str, per_rank: list[dict], ref: dict) -> dict[str, float]:
    """Assert loss and tokens on every rank and every gradient (merged over stages) equal the reference."""
    worst = {"loss": 0.0, "grad": 0.0}
    merged: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(per_rank):
        step = result["step"]
        assert step["trained_tokens"] == ref["step"]["trained_tokens"], (name, rank, step)
        assert ref["step"]["grad_norm"] > 0 and abs(step["grad_norm"] / ref["step"]["grad_norm"] - 1) < 1e-4, \
            (name, rank, step["grad_norm"], ref["step"]["grad_norm"])
        worst["loss"] = max(worst["loss"], abs(step["loss"] - ref["step"]["loss"]))
        for key, grad in result["grads"].items():
            base = key.removesuffix("#output")
            worst["grad"] = max(worst["grad"], float((grad - ref["grads"][base]).abs().max()))
            merged[base] = grad
    assert merged.keys() == ref["grads"].keys(), (name, sorted(set(ref["grads"]) ^ set(merged)))
    assert worst["loss"] < TOL and worst["grad"] < TOL, (name, worst)
    return worst


@pytest.mark.distributed
@pytest.mark.slow
def test_reference_is_sane(reference):
    print("reference", reference["step"], max(float(g.abs().max()) for g in reference["grads"].values()))
    assert 10.0 < reference["step"]["loss"] < 11.5 and reference["step"]["trained_tokens"] > 0
    assert len([k for k in reference["grads"] if k.endswith("self_attention.linear_qkv.weight")]) == 4


RECOMPUTE = ("model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1")
PP2_LAYOUTS = [(1, (PP2,)), (1, (PP2, "loss.fused_linear_cross_entropy=false")), (1, (PP2, VP2)),
               (1, (PP2, *RECOMPUTE))]


@pytest.fixture(scope="module")
def pp2_steps(setup, reference):  # noqa: F811
    """Per layout of ``PP2_LAYOUTS``, per rank: the step of one 2-process spawn from the reference's weights."""
    config_path, paths = setup
    per_layout = run_distributed(_layouts_worker, 2, config_path, paths, PP2_LAYOUTS, reference["weights"],
                                 timeout_s=400)
    return [[per_layout[r][i] for r in range(2)] for i in range(len(PP2_LAYOUTS))]


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_equals_single_process(pp2_steps, reference):
    stages = [[[(True, False, [0, 1])], [(False, True, [2, 3])]]] * 2 + [
        [[(True, False, [0]), (False, False, [2])], [(False, False, [1]), (False, True, [3])]]]   # interleaved
    for i, (_, overrides) in enumerate(PP2_LAYOUTS[:3]):
        per_rank = pp2_steps[i]
        assert [r["stages"] for r in per_rank] == stages[i], overrides
        assert per_rank[0]["layout"]["pipeline_model_parallel_size"] == 2
        print(overrides, _compare(str(overrides), per_rank, reference))


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_with_full_recompute_equals_single_process(pp2_steps, reference):
    """PP=2 with full activation recompute (uniform, 1 layer per checkpoint): loss and gradients equal the
    one-process step without recompute (within 1e-6)."""
    per_rank = pp2_steps[3]
    assert [r["stages"] for r in per_rank] == [[(True, False, [0, 1])], [(False, True, [2, 3])]]
    assert [r["recompute"] for r in per_rank] == [[("full", "uniform")]] * 2
    print("pp=2 full recompute", _compare("pp2 recompute", per_rank, reference))


PP4_LAYOUTS = [(1, ("parallel.pipeline_model_parallel_size=4",)),
               (1, (PP2, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")),
               (2, (PP2, "parallel.context_parallel_size=2"))]


@pytest.mark.distributed
@pytest.mark.slow
def test_pp4_pp2tp2_pp2cp2_equal_single_process(pp4_runs, reference):
    per_layout = [r[0] for r in pp4_runs]
    for i, (_, overrides) in enumerate(PP4_LAYOUTS):
        per_rank = [per_layout[r][i] for r in range(4)]
        if i == 0:      # one layer per stage; the middle stages have neither embedding nor output layer
            assert [r["stages"] for r in per_rank] == [[(True, False, [0])], [(False, False, [1])],
                                                       [(False, False, [2])], [(False, True, [3])]]
        print(overrides, _compare(str(overrides), per_rank, reference))


def _isolation_worker(rank, world_size, config_path, train_path):
    """Logits at PP=4 of a row and of the row with one token of its second conversation changed (last stage)."""
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(config_path, [*BASE, own_output_dir(config_path), f"data.train_path={train_path}",
                                                "parallel.pipeline_model_parallel_size=4"]))
    batch = trainer.next_micro_batches()[0]
    cu = batch["packed_seq_params"].cu_seqlens_q_padded.tolist()                 # row offsets
    changed = (cu[1] + cu[2]) // 2
    edited = dict(batch, tokens=batch["tokens"].clone())
    edited["tokens"][0, changed] = (edited["tokens"][0, changed] + 1000) % 49152
    with torch.no_grad():
        logits = [out["logits"][0] for out in trainer.schedule.run([batch, edited], forward_only=True, logits=True)]
        # the Megatron-Bridge bug: middle stages without cu_seqlens attend over the whole row
        forward = trainer.schedule.stage_forward

        def without_cu_seqlens(model, b, logits=False):
            gpt = model.module
            if not (gpt.pre_process or gpt.post_process):
                b = dict(b, packed_seq_params=None)
            return forward(model, b, logits=logits)

        trainer.schedule.stage_forward = without_cu_seqlens
        broken = [out["logits"][0] for out in trainer.schedule.run([batch, edited], forward_only=True, logits=True)]
    init = {n: p.detach().clone() for n, p in trainer.gpts[0].decoder.layers[0].named_parameters()}
    return {"stage": trainer.ctx.pp_rank, "cu": cu, "changed": changed, "logits": logits, "broken": broken,
            "init": init}


def _pp4_worker(rank, world_size, config_path, train_paths, layouts, full):
    """``_layouts_worker`` over ``layouts``, then ``_isolation_worker`` (4 processes)."""
    from megatron.core import parallel_state

    steps = _layouts_worker(rank, world_size, config_path, train_paths, layouts, full)
    parallel_state.destroy_model_parallel()
    return steps, _isolation_worker(rank, world_size, config_path, train_paths[1])


@pytest.fixture(scope="module")
def pp4_runs(setup, reference):  # noqa: F811
    """Per rank of one 4-process spawn: the steps of ``PP4_LAYOUTS`` and the isolation check's logits."""
    config_path, paths = setup
    return run_distributed(_pp4_worker, 4, config_path, paths, PP4_LAYOUTS, reference["weights"], timeout_s=700)


@pytest.mark.distributed
@pytest.mark.slow
def test_pp4_middle_stages_keep_conversations_apart(pp4_runs):
    """PP=4 (two middle stages): changing one token of one conversation changes no logit of another conversation;
    the same check fails when the middle stages are run without the packed-sequence parameters."""
    per_rank = [r[1] for r in pp4_runs]
    assert [r["logits"] == [] for r in per_rank] == [True, True, True, False]      # logits on the last stage only
    last = per_rank[3]
    cu, changed = last["cu"], last["changed"]
    assert len(cu) >= 4, cu                                                        # >= 3 conversations
    index = torch.arange(cu[-1])
    other = (index < cu[1]) | (index >= cu[2])
    after = (index >= changed) & (index < cu[2])
    before = (index >= cu[1]) & (index < changed)
    diff = (last["logits"][0] - last["logits"][1]).abs().amax(dim=-1)
    broken = (last["broken"][0] - last["broken"][1]).abs().amax(dim=-1)
    print("pp=4 max |logit diff| of other conversations:", diff[other].max().item(),
          "| later conversations with middle stages lacking cu_seqlens:", broken[index >= cu[2]].max().item())
    assert diff[other].max().item() <= 1e-6 and diff[before].max().item() <= 1e-6
    assert diff[after].max().item() > 1e-3
    assert broken[index >= cu[2]].max().item() > 1e-3              # the check would catch the cross-attention
    middle = [per_rank[1]["init"], per_rank[2]["init"]]           # layers 1 and 2, randomly initialised
    drawn = [n for n in middle[0] if "linear" in n]
    assert drawn and all(not torch.equal(middle[0][n], middle[1][n]) for n in drawn)    # seed + 100 x stage


def _records(output_dir) -> dict[str, dict[int, float]]:
    import json

    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {"train": {r["step"]: r["loss"] for r in records if r["kind"] == "train"},
            "val": {r["step"]: r["val_loss"] for r in records if r["kind"] == "validation"},
            "summary": [r for r in records if r["kind"] == "summary"]}


@pytest.mark.distributed
@pytest.mark.slow
def test_pp2_checkpoint_resumes_bit_exact_at_pp2_and_at_pp1(tmp_path, config):  # noqa: F811
    """``tools/train.py`` at PP=2 (megatron optimizer, validation every step), saved after each step; resumed from
    step 1 at PP=2 (bit-exact) and at PP=1 (resharded over stages); the distributed optimizer at PP=2 likewise."""
    pp2 = ("optimizer.backend=megatron", "parallel.pipeline_model_parallel_size=2", "train.train_steps=3",
           f"data.validation_path={yaml_train_path(config)}", "validation.val_period=1")
    _train(config, tmp_path / "full", 2, *pp2)
    full = _records(tmp_path / "full")
    assert sorted(full["train"]) == sorted(full["val"]) == [1, 2, 3] and abs(full["train"][2] - full["train"][1]) > 1e-2
    assert full["summary"][0]["pipeline_model_parallel_size"] == 2 and full["summary"][0]["data_parallel_size"] == 1
    saved = tmp_path / "full" / "checkpoints" / "iter_0000001"
    _train(config, tmp_path / "pp2", 2, *pp2, f"checkpoint.resume={saved}", NO_SAVE)
    pp1 = tuple(o for o in pp2 if "pipeline" not in o)
    _train(config, tmp_path / "pp1", 1, *pp1, f"checkpoint.resume={saved}", NO_SAVE)
    again, resharded = _records(tmp_path / "pp2"), _records(tmp_path / "pp1")
    print("uninterrupted", full["train"], full["val"], "| resumed pp=2", again["train"], again["val"],
          "| resumed pp=1", resharded["train"], resharded["val"])
    assert again["train"] == {s: full["train"][s] for s in (2, 3)}                  # bit-exact
    assert again["val"] == {s: full["val"][s] for s in (2, 3)}
    for kind in ("train", "val"):
        assert sorted(resharded[kind]) == [2, 3]
        assert all(abs(resharded[kind][s] - full[kind][s]) < 1e-5 for s in (2, 3)), (kind, resharded, full)

    dist_opt = (*pp2[:3], "optimizer.use_distributed_optimizer=true")
    _train(config, tmp_path / "dist", 2, *dist_opt)
    _train(config, tmp_path / "dist_resumed", 2, *dist_opt,
           f"checkpoint.resume={tmp_path / 'dist' / 'checkpoints' / 'iter_0000001'}", NO_SAVE)
    dist_full, dist_again = _records(tmp_path / "dist")["train"], _records(tmp_path / "dist_resumed")["train"]
    print("distributed optimizer pp=2", dist_full, "resumed", dist_again)
    assert abs(dist_full[1] - full["train"][1]) < 1e-6 and abs(dist_full[3] - full["train"][3]) < 1e-5
    assert dist_again == {s: dist_full[s] for s in (2, 3)}


def yaml_train_path(config_path) -> str:
    import yaml

    return yaml.safe_load(config_path.read_text())["data"]["train_path"]



@pytest.mark.parametrize("overrides, message", [
    (("optimizer.backend=megatron", "parallel.pipeline_model_parallel_size=3"), "multiple of parallel.pipeline"),
    (("parallel.virtual_pipeline_model_parallel_size=2",), "needs pipeline_model_parallel_size > 1"),
])
def test_pipeline_config_misfits_are_refused_by_name(tmp_path, config, overrides, message):  # noqa: F811
    with pytest.raises(ValueError, match=message):
        load_config(config, list(overrides))


def test_layout_check_explains_world_and_interleaved_misfits(config):  # noqa: F811
    from packsft.train.config import check_parallel_layout

    pp2 = ["optimizer.backend=megatron", "parallel.pipeline_model_parallel_size=2"]
    assert check_parallel_layout(load_config(config, pp2), 4) == 2
    with pytest.raises(ValueError, match=r"TP x CP x PP x DP"):
        check_parallel_layout(load_config(config, pp2), 3)
    vp = load_config(config, [*pp2, "model.num_layers=4", "parallel.virtual_pipeline_model_parallel_size=2",
                              "train.global_batch_size=6"])
    with pytest.raises(ValueError, match=r"micro-batches per step .* = 3\) to be a multiple of"):
        check_parallel_layout(vp, 4)                        # DP = 2: 3 micro-batches per rank


LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8.0")


def _lora_weights(config_path: str, train_path: str) -> dict[str, torch.Tensor]:
    """Full one-process weights of the LoRA model, with every adapter perturbed (``lora_B`` non-zero, so ``lora_A``
    gets a gradient), seeded by name."""
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(config_path, [*BASE, own_output_dir(config_path), f"data.train_path={train_path}",
                                                *LORA]))
    weights = {_global_name(g, n): p.detach().clone() for g in trainer.gpts for n, p in g.named_parameters()}
    weights["#initial adapters"] = {k: v.clone() for k, v in weights.items() if ".lora_" in k}
    for i, name in enumerate(sorted(k for k in weights if ".lora_" in k)):
        weights[name] += 0.05 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(i))
    return weights


def _lora_step(config_path: str, train_path: str, overrides: tuple[str, ...], full: dict) -> dict:
    from packsft.train.loop import Trainer

    trainer = Trainer(load_config(config_path, [*BASE, own_output_dir(config_path), f"data.train_path={train_path}",
                                                *LORA, *overrides]))
    initial = {_global_name(g, n): p.detach().clone() for g in trainer.gpts for n, p in g.named_parameters()
               if ".lora_" in n}
    load_full_weights(trainer, {k: v for k, v in full.items() if not k.startswith("#")})
    result = trainer.train_step(trainer.next_micro_batches())
    trainable = {_global_name(g, n): p for g in trainer.gpts for n, p in g.named_parameters() if p.requires_grad}
    return {"step": result, "grads": {k: p.main_grad.detach().clone() for k, p in trainable.items()},
            "after": {k: p.detach().clone() for k, p in trainable.items()}, "layout": trainer.layout(),
            "stages": [(g.pre_process, g.post_process) for g in trainer.gpts], "initial": initial}


def _lora_pp2_worker(rank, world_size, config_path, train_path, full):
    return _lora_step(config_path, train_path, (PP2,), full)


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_pp2_step_equals_single_process(setup, parallel_state_1proc):  # noqa: F811
    """LoRA at PP=2 (megatron optimizer, tied embeddings frozen): the step's loss, grad norm, every adapter's reduced
    gradient (within 1e-6) and updated value (within 1e-6 plus Adam's amplification of the gradient's difference)
    equal the one-process LoRA step; only adapters are trainable; each stage starts from the adapters one process
    draws."""
    from megatron.core import parallel_state

    config_path, paths = setup
    full = _lora_weights(config_path, paths[1])
    parallel_state.destroy_model_parallel()
    ref = _lora_step(config_path, paths[1], (), full)
    assert ref["grads"] and all(".lora_" in k for k in ref["grads"]) and len(ref["grads"]) == 4 * 4 * 2
    assert min(float(g.abs().max()) for g in ref["grads"].values()) > 0          # A and B get gradients
    per_rank = run_distributed(_lora_pp2_worker, 2, config_path, paths[1], full, timeout_s=400)
    assert [r["stages"] for r in per_rank] == [[(True, False)], [(False, True)]]
    initial = {k: v for r in per_rank for k, v in r["initial"].items()}     # the adapters each stage drew
    assert initial.keys() == full["#initial adapters"].keys()
    assert all(torch.equal(v, full["#initial adapters"][k]) for k, v in initial.items())     # as one process drew
    merged, worst, worst_after = {}, 0.0, 0.0
    lr, eps = ref["step"]["lr"], OptimizerConfig.adam_eps
    for result in per_rank:
        assert result["step"]["trained_tokens"] == ref["step"]["trained_tokens"]
        assert abs(result["step"]["loss"] - ref["step"]["loss"]) < TOL
        assert abs(result["step"]["grad_norm"] / ref["step"]["grad_norm"] - 1) < 1e-5
        for key, grad in result["grads"].items():
            diff = (grad - ref["grads"][key]).abs()
            worst = max(worst, float(diff.max()))
            # Adam's first step moves a weight by lr * g / (|g| + eps), whose slope in g is lr * eps / (|g| + eps)^2:
            # where |g| is near eps a float32 difference in g is amplified up to lr / eps times
            g = torch.minimum(grad.abs(), ref["grads"][key].abs()).masked_fill(grad * ref["grads"][key] < 0, 0)
            allowed = TOL + lr * eps * diff / (g + eps) ** 2
            worst_after = max(worst_after, float(((result["after"][key] - ref["after"][key]).abs() / allowed).max()))
            merged[key] = grad
    assert merged.keys() == ref["grads"].keys() and worst < TOL and worst_after < 1, (worst, worst_after)
    print("lora pp=2 vs pp=1: max |grad diff|", worst, "updated adapters: max |diff| / allowed", worst_after,
          "loss", ref["step"]["loss"])

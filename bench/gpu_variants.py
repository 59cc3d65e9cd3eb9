"""The training step's variants side by side on one device: tokens/s, MFU, peak memory, host syncs, parity.

Builds the trainer once (the same ``--config`` and ``KEY=VALUE`` overrides as ``tools/train.py``, one process; on a
GPU ``bench/gpu_check.sh`` passes the ~1B / 8K settings, on CPU toy sizes), draws the micro-batches of 2 steps once
(every variant trains on the same rows), snapshots the initial weights, then for each variant, cumulative in this
order unless said otherwise:

* ``base``: the step before issue 41: one SDPA per conversation (the kernel forced to the fallback loop), Megatron's
  THD RoPE (``packsft.model.rope.uninstall_sync_free_rope``), torch AdamW on its ``foreach`` path with Megatron's own
  gradient norm, clip and skip decision read back to the host (:func:`megatron_host_step`), the fused loss;
* ``varlen``: + the kernel ``select_attention_kernel`` picks (``varlen_attn`` on CUDA in bf16; the loop on CPU);
* ``rope``: + packsft's sync-free THD RoPE;
* ``fused_adam``: + fused AdamW, gradient norm and clip on the device: the trainer as built today;
* ``swiglu``: + ``model.bias_activation_fusion`` (Megatron's compiled SwiGLU; needs Triton on CUDA);
* ``compile``: + ``train.compile`` (``packsft.model.compile``: ``torch.compile`` of each transformer layer);
* ``stock_loss``: ``fused_adam`` with Megatron's full-logit loss (``loss.fused_linear_cross_entropy=false``);
* ``te``: ``fused_adam`` with ``model.attention_backend=te``, in a child process of this script (its own weights: no
  parity); skipped when ``transformer_engine`` does not import.

Per variant, after restoring the weights, the optimizer state and the schedule: one forward + backward without an
update on step 1's rows (the loss per trained token and the gradient norm, compared with ``base``'s: relative
``--loss-rtol`` / ``--norm-rtol``, defaults by dtype: bf16 5e-3 / 3e-2, fp32 1e-5 / 1e-4); ``--warmup`` full steps;
one step with its host syncs counted (CUDA: ``torch.cuda.set_sync_debug_mode("warn")``, one warning per synchronising
call; CPU: every call of a tensor -> host read, ``HOST_READS``, by any code, patched for the step: the reads
``tests/train/test_step_syncs.py`` counts); ``--timed`` full steps, synchronised: step time, tokens/s (all row
positions), peak memory (CUDA), and MFU two ways over the device's dense bf16 peak (from its name,
``bench/gpu_check_train.py``; printed; none on CPU): ``6 P tokens`` and ``6 P tokens + 6 h l sum(s_i^2)``, causal
attention counted from the rows' real conversation lengths ``s_i`` (h = heads x head dim, l layers), not ``L^2``.
Each variant runs under a time cap (SIGALRM, ``--cap-s``; ``compile``/``swiglu`` get ``--compile-cap-s``; ``--caps
NAME=SECONDS`` overrides one); a variant that fails or overruns is a row with its error and the run goes on; the undo
of its switches runs either way. ``--json`` and ``--text`` are rewritten after every variant. Exit status 1 when a
variant failed or missed parity.

    python bench/gpu_variants.py --config configs/tiny_cpu.yaml [overrides ...] --variants base,rope --json v.json
    GPU_CHECK_PARTS=variants bash bench/gpu_check.sh        # the ~1B / 8K run on one GPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from packsft.train.metrics import peak_tflops  # noqa: E402

ORDER = ("base", "varlen", "rope", "fused_adam", "swiglu", "compile", "stock_loss", "te")
HOST_READS = [(torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                                                 "nonzero", "cpu", "numpy")] + [(torch, "nonzero")]


@dataclasses.dataclass(frozen=True)
class Variant:
    """The switches of one variant (see the module docstring)."""

    attention: str = "auto"           # "loop": the per-conversation SDPA fallback forced; "auto": the kernel selected
    sync_free_rope: bool = True
    fused_optimizer: bool = True      # False: foreach AdamW and Megatron's host-side norm and clip
    swiglu_fusion: bool = False
    compile: bool = False
    fused_loss: bool = True


VARIANTS = {
    "base": Variant(attention="loop", sync_free_rope=False, fused_optimizer=False),
    "varlen": Variant(sync_free_rope=False, fused_optimizer=False),
    "rope": Variant(fused_optimizer=False),
    "fused_adam": Variant(),
    "swiglu": Variant(swiglu_fusion=True),
    "compile": Variant(swiglu_fusion=True, compile=True),
    "stock_loss": Variant(fused_loss=False),
}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Other arguments are tools/train.py's KEY=VALUE overrides.")
    p.add_argument("--config", required=True, help="training YAML, as tools/train.py --config")
    p.add_argument("--variants", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    p.add_argument("--warmup", type=int, default=2, help="full steps before the counted and timed ones")
    p.add_argument("--timed", type=int, default=3, help="timed full steps")
    p.add_argument("--cap-s", type=float, default=60.0, help="time cap of one variant, seconds")
    p.add_argument("--compile-cap-s", type=float, default=150.0, help="time cap of swiglu and compile, seconds")
    p.add_argument("--caps", nargs="*", default=[], metavar="NAME=SECONDS", help="per-variant time caps")
    p.add_argument("--loss-rtol", type=float, default=None, help="parity tolerance of the loss (default by dtype)")
    p.add_argument("--norm-rtol", type=float, default=None, help="parity tolerance of the grad norm (by dtype)")
    p.add_argument("--json", default=None, help="results as JSON, rewritten after each variant")
    p.add_argument("--text", default=None, help="the table as text, rewritten after each variant")
    args, overrides = p.parse_known_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in ORDER]
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if unknown or bad:
        p.error(f"unknown variant(s) {unknown} (known: {', '.join(ORDER)})" if unknown else f"unknown arguments {bad}")
    try:
        args.caps = {k: float(v) for k, v in (c.split("=", 1) for c in args.caps)}
    except ValueError:
        p.error(f"--caps takes NAME=SECONDS, got {args.caps}")
    return args, overrides


# -- the old optimizer step, for base ----------------------------------------------------------------------------------
def megatron_host_step(optimizer, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Megatron step as packsft ran it before issue 41: ``get_grad_norm`` read back to the host (one read per
    parameter without TE/Apex on CUDA), the finite checks on the host, Megatron's ``clip_grad_by_total_norm_fp32``,
    ``step_with_ready_grads``. Same contract as ``packsft.train.optim.megatron_step_skipping_non_finite``."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from packsft.train.grad_clip import torch_optimizers

    for opt in torch_optimizers(optimizer):     # the foreach kernel takes no device-side skip
        opt.found_inf = None
    found_inf = optimizer.prepare_grads()
    norm = float(optimizer.get_grad_norm())
    if found_inf or not math.isfinite(norm) or not bool(torch.isfinite(loss_sum)):
        return torch.tensor(True, device=loss_sum.device), torch.tensor(norm)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    optimizer.step_with_ready_grads()
    return torch.tensor(False, device=loss_sum.device), torch.tensor(norm)


# -- switches ----------------------------------------------------------------------------------------------------------
def _core_attentions(trainer):
    from packsft.model.attention import TorchCoreAttention

    return [m for gpt in trainer.gpts for m in gpt.modules() if isinstance(m, TorchCoreAttention)]


def _configs(trainer):
    """The distinct ``TransformerConfig`` objects of the model's modules."""
    seen = {}
    for gpt in trainer.gpts:
        for module in gpt.modules():
            cfg = getattr(module, "config", None)
            if cfg is not None and hasattr(cfg, "bias_activation_fusion"):
                seen[id(cfg)] = cfg
    return list(seen.values())


@contextlib.contextmanager
def applied(trainer, variant: Variant):
    """Switch ``trainer`` to ``variant`` for the duration; every switch is undone on exit (also after an error)."""
    import packsft.train.loop as loop
    from packsft.model import rope
    from packsft.model.attention import AttentionKernel
    from packsft.model.compile import compile_transformer_layers
    from packsft.train.grad_clip import torch_optimizers, use_fused_adamw

    undo = []
    try:
        cores = _core_attentions(trainer)
        if variant.attention == "loop":                  # force the fallback: one SDPA per conversation
            for core in cores:
                core.kernel = AttentionKernel("sdpa per conversation (forced: base)", None)
        undo.append(lambda: [setattr(core, "kernel", None) for core in cores])   # re-selected at the next call
        if not variant.sync_free_rope:
            rope.uninstall_sync_free_rope()
            undo.append(rope.install_sync_free_rope)
        if not variant.fused_optimizer:                  # Megatron's build without TE/Apex: foreach, host-side norm
            for opt in torch_optimizers(trainer.optimizer):
                for group in opt.param_groups:
                    group["fused"], group["foreach"] = None, None
            undo.append(lambda: use_fused_adamw(trainer.optimizer))
            loop.megatron_step_skipping_non_finite = megatron_host_step
            undo.append(lambda: setattr(loop, "megatron_step_skipping_non_finite",
                                        sys.modules["packsft.train.optim"].megatron_step_skipping_non_finite))
        if variant.swiglu_fusion:
            configs = [c for c in _configs(trainer) if not c.bias_activation_fusion]
            for cfg in configs:
                cfg.bias_activation_fusion = True
            undo.append(lambda: [setattr(c, "bias_activation_fusion", False) for c in configs])
        if variant.compile and not trainer.cfg.train.compile:
            undo.append(lambda: _uncompile(trainer))
            for gpt in trainer.gpts:
                compile_transformer_layers(gpt)
        if not variant.fused_loss:
            was = trainer.cfg.loss.fused_linear_cross_entropy
            trainer.cfg.loss.fused_linear_cross_entropy = False
            undo.append(lambda: setattr(trainer.cfg.loss, "fused_linear_cross_entropy", was))
        yield
    finally:
        for step in reversed(undo):
            step()


def _uncompile(trainer) -> None:
    """Undo ``compile_transformer_layers``: eager layer calls and the core attention's own ``forward``."""
    for gpt in trainer.gpts:
        for layer in gpt.decoder.layers:
            layer._compiled_call_impl = None
            layer.self_attention.core_attention.__dict__.pop("forward", None)
    torch._dynamo.reset()


# -- state -------------------------------------------------------------------------------------------------------------
def _inner_state(trainer) -> list[dict]:
    from packsft.train.grad_clip import torch_optimizers

    return [{p: {k: (v.to("cpu", copy=True), v.device) if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in opt.state.items()} for opt in torch_optimizers(trainer.optimizer)]


def snapshot(trainer) -> dict:
    """The initial model weights, the inner torch optimizers' state (copies in host memory, so the device's peak
    memory is the trainer's own) and the schedule position."""
    return {"params": [p.detach().to("cpu", copy=True) for p in trainer.model.parameters()],
            "state": _inner_state(trainer),
            "step": trainer.scheduler.last_epoch}


def restore(trainer, snap: dict) -> None:
    """Put back :func:`snapshot`: weights (and Megatron's fp32 master copies), optimizer state, schedule, no grads."""
    from packsft.train.grad_clip import torch_optimizers
    from packsft.train.optim import set_schedule_step

    with torch.no_grad():
        for p, saved in zip(trainer.model.parameters(), snap["params"]):
            p.copy_(saved)
    for opt, state in zip(torch_optimizers(trainer.optimizer), snap["state"]):
        opt.state.clear()
        for p, s in state.items():
            opt.state[p] = {k: v[0].to(v[1], copy=True) if isinstance(v, tuple) else v for k, v in s.items()}
    trainer.optimizer.reload_model_params()
    trainer.model.zero_grad_buffer()
    set_schedule_step(trainer.scheduler, snap["step"])
    trainer.optimizer.zero_grad()


def forward_backward(trainer, batches) -> tuple[float, float]:
    """One forward + backward of ``batches`` as the step does it, no update: (loss per trained token, grad norm).

    The norm is over the model's gradients (``main_grad`` with Megatron's DDP) after the DP x CP reduction."""
    from megatron.core.distributed import finalize_model_grads

    from packsft.loss import global_num_trained_tokens, normalize_loss
    from packsft.train.token_loss import gpt_token_loss

    cfg = trainer.cfg
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    count = global_num_trained_tokens([b["loss_mask"] for b in batches], (trainer.ctx.dp_cp_group,),
                                      labels=[b["labels"] for b in batches])
    autocast = (torch.autocast("cuda", dtype=getattr(torch, cfg.train.autocast_dtype)) if cfg.train.autocast_dtype
                else contextlib.nullcontext())
    loss_sum = torch.zeros((), dtype=torch.float32, device=trainer.ctx.device)
    for batch in batches:
        with autocast:
            per_token, _ = gpt_token_loss(trainer.model, batch, fused=cfg.loss.fused_linear_cross_entropy,
                                          chunk_size=cfg.loss.chunk_size)
        token_loss_sum = per_token.sum()
        normalize_loss(token_loss_sum, count, 1).backward()
        loss_sum += token_loss_sum.detach().float()
    finalize_model_grads([trainer.model])
    grads = [getattr(p, "main_grad", None) for p in trainer.model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads
                                                 if g is not None]))
    result = (float(loss_sum / count.clamp(min=1)), float(norm))
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    return result


@contextlib.contextmanager
def counted_host_reads():
    """Count tensor -> host reads (``HOST_READS``: ``Tensor.item``, ``tolist``, ``__bool__``, ...) by any code while
    active, by patching them on ``torch.Tensor`` / ``torch``: the CPU proxy of CUDA syncs. Yields a one-item list."""
    count = [0]
    originals = [(owner, name, getattr(owner, name)) for owner, name in HOST_READS]

    def counting(original):
        def read(*args, **kwargs):
            if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
                count[0] += 1
            return original(*args, **kwargs)
        return read

    for owner, name, original in originals:
        setattr(owner, name, counting(original))
    try:
        yield count
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def count_syncs(step) -> int:
    """Host syncs of ``step()``: CUDA sync-debug warnings on a GPU, counted host reads on CPU."""
    if not torch.cuda.is_available():
        with counted_host_reads() as count:
            step()
        return count[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class VariantTimeout(Exception):
    """A variant ran past its time cap."""


@contextlib.contextmanager
def time_cap(seconds: float):
    """Raise :class:`VariantTimeout` in the main thread after ``seconds`` (SIGALRM)."""
    def on_alarm(signum, frame):
        raise VariantTimeout(f"over its time cap of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- FLOPs -------------------------------------------------------------------------------------------------------------
def flops_per_step(trainer, steps, parameters: int) -> tuple[float, float]:
    """``(6 P tokens, causal attention FLOPs)`` of one step (mean over ``steps``), fwd + bwd.

    Attention: per conversation of ``s`` real tokens and per layer ``2 s^2 h`` forward (QK^T and PV, causal half of
    ``2 * 2 s^2 h``), three times that with the backward: ``6 h l sum(s^2)``, ``h`` = heads x head dim."""
    m = trainer.cfg.model
    h = m.num_attention_heads * m.head_dim
    tokens = trainer.cfg.train.global_batch_size * trainer.cfg.data.max_seq_len
    squares = [sum((e - s) ** 2 for s, e in zip(cu[:-1], cu[1:])) for cu in steps_cu(steps)]
    dp = trainer.ctx.data_parallel_size
    return 6.0 * parameters * tokens, 6.0 * h * m.num_layers * sum(squares) / len(steps) * dp


def steps_cu(steps) -> list[list[int]]:
    """Per step, the real conversation offsets of all its micro-batches concatenated (host ints, read once)."""
    out = []
    for batches in steps:
        cu = [0]
        for b in batches:
            offsets = b["packed_seq_params"].cu_seqlens_q.tolist()
            cu += [cu[-1] + e - s for s, e in zip(offsets[:-1], offsets[1:])]
        out.append(cu)
    return out


# -- one variant -------------------------------------------------------------------------------------------------------
def run_variant(trainer, name: str, steps, snap, args, flops, peak) -> dict:
    """The measurements of one variant (module docstring); raises on failure."""
    restore(trainer, snap)
    with applied(trainer, VARIANTS[name]):
        start = time.perf_counter()
        loss, norm = forward_backward(trainer, steps[0])
        kernels = sorted({core.kernel.name for core in _core_attentions(trainer) if core.kernel is not None})
        for i in range(args.warmup):
            trainer.step_tensors(steps[i % len(steps)])
        _sync()
        first = time.perf_counter() - start
        syncs = count_syncs(lambda: trainer.step_tensors(steps[0]))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _sync()
        start = time.perf_counter()
        for i in range(args.timed):
            out = trainer.step_tensors(steps[i % len(steps)])
        _sync()
        step_s = (time.perf_counter() - start) / args.timed
        last_loss = float(out["loss"])
    tokens = trainer.cfg.train.global_batch_size * trainer.cfg.data.max_seq_len
    six_p, attention = flops
    return {"name": name, "ok": True, "loss": loss, "grad_norm": norm, "attention_kernel": ", ".join(kernels) or "-",
            "syncs_per_step": syncs, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu_6p": six_p / step_s / peak if peak else None,
            "mfu_attention": (six_p + attention) / step_s / peak if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "first_steps_s": first, "last_loss": last_loss}


def run_te_child(args, overrides, output_dir: str) -> dict:
    """``fused_adam`` with ``model.attention_backend=te`` in a child process of this script (own model and weights,
    run folder ``<output_dir>/te``: this process holds the lock of ``output_dir``)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return {"name": "te", "ok": None, "error": "skipped: transformer_engine does not import"}
    out = Path(args.json or "variants.json").with_name("variants_te.json")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()                     # the child shares the device
    cmd = [sys.executable, __file__, "--config", args.config, "--variants", "fused_adam", "--json", str(out),
           "--warmup", str(args.warmup), "--timed", str(args.timed), "--cap-s", str(args.cap_s),
           *overrides, "model.attention_backend=te", f"logging.output_dir={Path(output_dir) / 'te'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cap_s + 120)
    try:
        row = json.loads(out.read_text())["variants"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {"name": "te", "ok": False, "error": f"child exit {proc.returncode}: "
                                                    f"{(proc.stderr.strip().splitlines() or [''])[-1][:200]}"}
    return {**row, "name": "te", "parity": "n/a (own weights)"}


# -- report ------------------------------------------------------------------------------------------------------------
def _fmt(row: dict) -> str:
    if not row.get("ok"):
        return f"{row['name']:<11} {'FAIL' if row.get('ok') is False else '-':<5} {row.get('error', '')}"
    mfu = (f"{row['mfu_6p']:6.1%} {row['mfu_attention']:6.1%}" if row["mfu_6p"] is not None
           else f"{'n/a':>6} {'n/a':>6}")
    mem = f"{row['peak_mem_gib']:7.1f}" if row["peak_mem_gib"] is not None else f"{'n/a':>7}"
    return (f"{row['name']:<11} {'ok':<5} {row['tokens_per_s']:10.0f} {row['step_s']:8.3f} {mfu} {mem} "
            f"{row['syncs_per_step']:6d} {row['loss']:10.6f} {row['grad_norm']:10.4g} {row.get('parity', '-'):<14} "
            f"{row['attention_kernel']}")


HEADER = (f"{'variant':<11} {'':<5} {'tokens/s':>10} {'step s':>8} {'MFU6P':>6} {'MFU+at':>6} {'mem GiB':>7} "
          f"{'syncs':>6} {'loss':>10} {'grad norm':>10} {'parity':<14} attention kernel")


def write(args, meta: dict, rows: list[dict]) -> str:
    text = "\n".join([*meta["notes"], HEADER, *map(_fmt, rows)]) + "\n"
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "variants": rows}, indent=1))
    if args.text:
        Path(args.text).write_text(text)
    return text


def parity(row: dict, ref: dict | None, loss_rtol: float, norm_rtol: float) -> str:
    """``ok``/``FAIL`` with the relative differences of loss and grad norm from ``ref`` (``base``)."""
    if ref is None or not ref.get("ok"):
        return "no base"
    dl = abs(row["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
    dn = abs(row["grad_norm"] - ref["grad_norm"]) / max(abs(ref["grad_norm"]), 1e-12)
    row["loss_rel_diff"], row["norm_rel_diff"] = dl, dn
    return f"{'ok' if dl <= loss_rtol and dn <= norm_rtol else 'FAIL'} {max(dl, dn):.1e}"


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parse(argv)
    from packsft.train.config import load_config
    from packsft.train.distributed import destroy_distributed
    from packsft.train.loop import Trainer

    start = time.perf_counter()
    trainer = Trainer(load_config(args.config, overrides))
    try:
        summary = trainer.summary()
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        tflops = peak_tflops(gpu) if torch.cuda.is_available() else None
        peak = tflops * 1e12 if tflops else None
        bf16 = trainer.cfg.train.bf16 or trainer.cfg.train.autocast_dtype is not None
        loss_rtol = args.loss_rtol if args.loss_rtol is not None else (5e-3 if bf16 else 1e-5)
        norm_rtol = args.norm_rtol if args.norm_rtol is not None else (3e-2 if bf16 else 1e-4)
        steps = [trainer.next_micro_batches() for _ in range(2)]      # the same rows for every variant
        flops = flops_per_step(trainer, steps, summary["parameters"])
        snap = snapshot(trainer)
        triton = importlib.util.find_spec("triton")
        notes = [f"device {gpu}; torch {torch.__version__}; triton "
                 f"{__import__('triton').__version__ if triton else 'not installed'}; trainer built in "
                 f"{time.perf_counter() - start:.1f} s",
                 f"model {summary['parameters'] / 1e9:.3f} B parameters; {trainer.cfg.train.global_batch_size} x "
                 f"{trainer.cfg.data.max_seq_len} tokens per step; optimizer as built: {summary['optimizer']}; "
                 f"{'bf16' if bf16 else 'fp32'}",
                 f"MFU over a dense bf16 peak of {tflops:g} TFLOP/s assumed from the device name; attention FLOPs "
                 f"from the real conversation lengths: {flops[1] / flops[0]:.2%} of 6 P tokens" if tflops else
                 f"MFU: no dense bf16 peak known for '{gpu}'; attention FLOPs {flops[1] / flops[0]:.2%} of 6 P tokens",
                 f"parity vs base: one forward + backward of step 1's rows, relative loss <= {loss_rtol:g}, "
                 f"grad norm <= {norm_rtol:g}; syncs: one step, "
                 + ("CUDA sync debug mode" if torch.cuda.is_available() else "host reads counted (CPU)")]
        meta = {"device": gpu, "torch": torch.__version__, "peak_tflops": tflops, "parameters": summary["parameters"],
                "tokens_per_step": trainer.cfg.train.global_batch_size * trainer.cfg.data.max_seq_len,
                "flops_6p_per_step": flops[0], "attention_flops_per_step": flops[1], "notes": notes}
        print("\n".join(notes + [HEADER]), flush=True)
        rows: list[dict] = []
        ref = None
        for name in args.variants:
            cap = args.caps.get(name, args.compile_cap_s if name in ("swiglu", "compile") else args.cap_s)
            try:
                if name == "te":
                    row = run_te_child(args, overrides, trainer.cfg.logging.output_dir)
                else:
                    with time_cap(cap):
                        row = run_variant(trainer, name, steps, snap, args, flops, peak)
            except Exception as err:  # noqa: BLE001 - a failed variant is a row, not the end of the run
                row = {"name": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
                print(traceback.format_exc(), file=sys.stderr, flush=True)
            if row.get("ok") and name != "te":
                if name == "base":
                    ref, row["parity"] = row, "reference"
                else:
                    row["parity"] = parity(row, ref, loss_rtol, norm_rtol)
            rows.append(row)
            write(args, meta, rows)
            print(_fmt(row), flush=True)
        failed = [r["name"] for r in rows if r.get("ok") is False or str(r.get("parity", "")).startswith("FAIL")]
        print(f"failed: {', '.join(failed)}" if failed else "all variants ran", flush=True)
        return 1 if failed else 0
    finally:
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())

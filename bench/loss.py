"""Peak memory and time of the LM-head loss: full logits vs packsft's chunked fused linear cross-entropy.

One forward + backward of ``loss = CE(hidden [t, h] @ weight[v, h].T, labels)`` (sum over trained tokens,
1/7 of labels ignored) for each variant, each in a fresh subprocess so that peak memory is honest:
CPU peak is the process high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before
the step) minus the resident size just before the step; ``tracemalloc`` does not see torch's allocator.
CUDA peak is ``torch.cuda.max_memory_allocated`` minus the allocation before the step.

Variants: ``naive`` (``F.cross_entropy`` on full logits), ``megatron`` (Megatron-Core
``tensor_parallel.vocab_parallel_cross_entropy`` on full logits, TP=1, times ``loss_mask``) and
``chunked-<c>`` (``packsft.loss.fused_linear_cross_entropy``, chunk of ``c`` tokens). The peaks include
the weight gradient (``v * h * 4`` bytes in fp32), which every variant must produce. ``--warmup`` untimed steps
come first; the time is the fastest of ``--repeats`` steps, the memory the first's. Each chunked row says whether it
meets issue 41's target (within 1.2x naive's time at <= 0.1x its memory) and each table ends with the chunk sizes
that do: what the default chunk size is chosen from.

    python bench/loss.py                                    # t=4096, v in {32768, 131072}, CPU, fp32
    python bench/loss.py --t 4096 16384 --chunk-sizes 256 1024
    python bench/loss.py --device cuda --dtype bf16 --t 4096 16384
    python bench/loss.py --device cuda --dtype bf16 --t 32768 --v 131072 --h 4096 --chunk-sizes 1024 2048 4096 8192 \
        --repeats 3                                         # issue 41's target shape (bench/gpu_check.sh, part loss)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

MIB = 2**20
TARGET_TIME, TARGET_MEMORY = 1.2, 0.1   # issue 41: chunked fused CE within 1.2x naive's time at <= 0.1x its memory


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--t", type=int, nargs="+", default=[4096], help="tokens per step")
    p.add_argument("--v", type=int, nargs="+", default=[32768, 131072], help="vocabulary sizes")
    p.add_argument("--h", type=int, default=1024, help="hidden size")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="timed steps (the first one also measures memory)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first (GEMM heuristics, allocator growth, lazy initialisation)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _free_memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def _estimated_bytes(variant: str, t: int, v: int, h: int, elem: int) -> int:
    """Rough peak of a variant above baseline (from the measurements in docs/performance.md)."""
    weight_grad = v * h * 4
    if variant == "naive":  # logits, fp32 copy, log-softmax, its gradient (49,152 MiB at 32K x 128K bf16 on an H200)
        return t * v * (2 * elem + 8) + weight_grad
    if variant == "megatron":  # logits (upcast), exp in place, gradient in place
        return int(1.3 * t * v * 4) + weight_grad
    chunk = int(variant.split("-")[1])
    return 3 * min(chunk, t) * v * 4 + weight_grad + 2 * t * h * 4


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _init_megatron_tp1(device: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def _step(variant: str, hidden, weight, labels, loss_mask):
    import torch
    import torch.nn.functional as F

    if variant == "naive":
        loss = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="sum")
    elif variant == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = (hidden @ weight.t()).float()
        loss = (vocab_parallel_cross_entropy(logits, labels.clamp(min=0)) * loss_mask).sum()
    else:
        from packsft.loss import fused_linear_cross_entropy

        chunk = int(variant.split("-")[1])
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, reduction="sum")
    loss.backward()
    return float(loss), float(torch.linalg.vector_norm(weight.grad.float()))


def _worker(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    t, v = args.t[0], args.v[0]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.worker == "megatron":
        _init_megatron_tp1(args.device)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(t, args.h, generator=g) / args.h**0.25).to(args.device, dtype).requires_grad_()
    weight = (torch.randn(v, args.h, generator=g) / args.h**0.25).to(args.device, dtype).requires_grad_()
    labels = torch.randint(0, v, (t,), generator=g)
    labels[::7] = -100
    labels = labels.to(args.device)
    loss_mask = (labels != -100).float()
    (hidden[:8] @ weight[:8].t()).sum()  # load the GEMM library before the baseline
    cuda = args.device == "cuda"
    for _ in range(args.warmup):
        hidden.grad = weight.grad = None
        _step(args.worker, hidden, weight, labels, loss_mask)
    times = []
    for i in range(args.repeats):
        hidden.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        elif i == 0:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            base = _rss_bytes("VmRSS")
        start = time.perf_counter()
        loss, grad_norm = _step(args.worker, hidden, weight, labels, loss_mask)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i == 0:
            peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")
            peak_mib = (peak - base) / MIB
    return {"peak_mib": peak_mib, "time_s": min(times), "loss": loss, "grad_norm": grad_norm}


def _run_variant(args, variant: str, t: int, v: int) -> dict | str:
    elem = 4 if args.dtype == "fp32" else 2
    need, free = _estimated_bytes(variant, t, v, args.h, elem), _free_memory_bytes(args.device)
    if need > 0.85 * free:
        return f"skipped: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--t", str(t), "--v", str(v),
           "--h", str(args.h), "--dtype", args.dtype, "--device", args.device,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(res: dict, ref: dict | str | None, key: str) -> str:
    return f"{res[key] / ref[key]:.2f}" if isinstance(ref, dict) else "-"


def _target(res: dict, naive: dict | str | None) -> str:
    """Whether a chunked row meets the target: within ``TARGET_TIME`` x naive's time at <= ``TARGET_MEMORY`` x its
    memory."""
    if not isinstance(naive, dict):
        return ""
    missed = [what for what, ok in (("time", res["time_s"] <= TARGET_TIME * naive["time_s"]),
                                    ("memory", res["peak_mib"] <= TARGET_MEMORY * naive["peak_mib"])) if not ok]
    return f"  target: misses ({' and '.join(missed)})" if missed else "  target: meets"


def main(argv=None) -> None:
    """Run every variant for every (t, v) and print one table per size, then the chunk sizes against the target."""
    args = _parse(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    variants = ["naive", "megatron"] + [f"chunked-{c}" for c in args.chunk_sizes]
    print(f"device={args.device} dtype={args.dtype} h={args.h} threads={args.threads or 'default'} "
          f"warm-up={args.warmup} repeats={args.repeats} (time: the fastest repeat); "
          "peak = memory above the pre-step baseline, incl. the weight gradient; "
          f"target: chunked within {TARGET_TIME}x naive's time at <= {TARGET_MEMORY}x its memory")
    for t in args.t:
        for v in args.v:
            print(f"\nt={t} v={v}  (full fp32 logits: {t * v * 4 / MIB:.0f} MiB, "
                  f"weight grad: {v * args.h * 4 / MIB:.0f} MiB)")
            print(f"{'variant':<14}{'peak MiB':>10}{'time s':>9}{'mem/naive':>11}{'time/naive':>12}"
                  f"{'mem/megatron':>14}  loss / |grad W|")
            rows = {}
            for variant in variants:
                rows[variant] = res = _run_variant(args, variant, t, v)
                if isinstance(res, str):
                    print(f"{variant:<14}{res}")
                    continue
                naive, meg = rows.get("naive"), rows.get("megatron")
                print(f"{variant:<14}{res['peak_mib']:>10.0f}{res['time_s']:>9.2f}"
                      f"{_ratio(res, naive, 'peak_mib'):>11}{_ratio(res, naive, 'time_s'):>12}"
                      f"{_ratio(res, meg, 'peak_mib'):>14}  "
                      f"{res['loss']:.6g} / {res['grad_norm']:.6g}"
                      f"{_target(res, naive) if variant.startswith('chunked') else ''}", flush=True)
            meeting = [c for c in args.chunk_sizes if isinstance(rows[f"chunked-{c}"], dict)
                       and _target(rows[f"chunked-{c}"], rows.get("naive")) == "  target: meets"]
            if isinstance(rows.get("naive"), dict):
                fastest = min(meeting, key=lambda c: rows[f"chunked-{c}"]["time_s"], default=None)
                print(f"chunk sizes meeting the target: {', '.join(map(str, meeting)) or 'none'}"
                      + (f"; fastest: {fastest}" if fastest else ""), flush=True)


if __name__ == "__main__":
    main()

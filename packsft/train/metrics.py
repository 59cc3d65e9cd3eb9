"""Training outputs on rank 0: tqdm progress, ``metrics.jsonl``, TensorBoard events, and the start-of-run summary.

``metrics.jsonl`` (appended across resumes, one JSON object per line):

* ``{"kind": "train", "step", "loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens_per_s", "packing_efficiency",
  "mfu", "trained_tokens", "consumed_samples", "consumed_tokens", "step_time_s", "mem_gib"}``: ``loss`` is the
  global-batch loss (nats, ``docs/loss.md``); ``grad_norm`` the TP-aware L2 norm before clipping; ``tokens_per_s``
  all row tokens of the global batch (padding included) per second, ``trained_tokens_per_s`` the trained tokens per
  second, ``packing_efficiency`` real tokens / row tokens, ``mfu`` the model FLOPs utilisation against the GPUs' dense
  bf16 peak (``6 P`` per row token + causal attention ``6 h l sum(s_i^2)`` over the real conversation lengths; null
  on a CPU or an unknown GPU), each over the steps since the previous logging step; ``trained_tokens`` the global
  trained-token count of the step; ``mem_gib`` the peak CUDA memory allocated (GPU) or the process's peak RSS (CPU),
  GiB. A mixture of training sources adds ``"total_trained_tokens/<name>"`` (each source's trained tokens since step 0,
  counted from the rows trained, resumes included) and ``"trained_token_share/<name>"`` (its share of them). An
  image-text run (a LLaVA model) adds ``image_tokens`` and ``text_tokens``: the image-token ids and the other real
  tokens of all rows (padding left out) since the previous logging step, global.
* ``{"kind": "validation", "step", "val_loss", "val_trained_tokens", "val_loss/<name>", "val_trained_tokens/<name>"}``:
  all validation sets together (token-weighted), then each named set.
* ``{"kind": "summary", ...}``: the run summary, once per start.

While the bar is shown, Python warnings (``warnings.showwarning``) and ``logging`` records go through ``tqdm.write``,
so a warning (e.g. a row truncated by the loader in this process) prints on its own line instead of breaking the bar.

A resumed run appends records for the steps after its checkpoint. Records an interrupted run wrote past the
checkpoint it resumes from (steps the checkpoint does not hold, and a line cut by a kill) are first moved to
``metrics.discarded.jsonl`` (:func:`set_aside_records_after`), so every step is logged once; a run that starts from
step 0 with no checkpoint sets aside every earlier record. TensorBoard hides the same steps (``purge_step``).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def peak_memory_gib() -> float:
    """Peak CUDA memory allocated on this device (GPU) or peak resident set size of this process (CPU), in GiB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


METRICS_FILE, DISCARDED_FILE = "metrics.jsonl", "metrics.discarded.jsonl"


def set_aside_records_after(output_dir: str | Path, step: int) -> int:
    """Move ``metrics.jsonl`` records past ``step`` (and lines that are not JSON) to ``metrics.discarded.jsonl``.

    Args:
        output_dir: run folder. step: the step training restarts from (-1: set aside every record).

    Returns:
        Lines moved (appended to ``metrics.discarded.jsonl``; ``metrics.jsonl`` is rewritten atomically).
    """
    from packsft.io import atomic_open

    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        (kept if keep else moved).append(line)
    if moved:
        with open(Path(output_dir) / DISCARDED_FILE, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in moved))
        with atomic_open(path) as f:
            f.write("".join(line + "\n" for line in kept))
    return len(moved)


PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 peak TFLOP/s of a GPU, by a part of its name (``torch.cuda.get_device_name``)."""


def peak_tflops(gpu_name: str) -> float | None:
    """bf16 dense peak of a GPU from its name, or None when unknown."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu_name), None)


def row_lengths(batches: list[dict[str, Any]]) -> torch.Tensor:
    """``[real tokens, sum of squared conversation lengths]`` (int64, on the device) of micro-batches: from each
    one's ``packed_seq_params.cu_seqlens_q`` (the real conversation offsets of its rows); no host read."""
    cus = [b["packed_seq_params"].cu_seqlens_q.long() for b in batches]
    return torch.stack([sum(cu[-1] for cu in cus), sum(((cu[1:] - cu[:-1]) ** 2).sum() for cu in cus)])


class StepMeter:
    """The training steps between two logging steps, counted on the device: ``add`` per step reads nothing back;
    ``should_log`` says which steps are logged (every ``log_interval``-th and the last); ``read`` moves the counts
    into the run's state with one host read (logging steps, checkpoints); ``record`` is a logging step's
    ``metrics.jsonl`` record.

    Args:
        device: where the counters live.
        log_interval: ``logging.log_interval``, steps.
        last_step: the run's last step (``train.stop_at_step`` or ``train.train_steps``).
        max_skipped_steps: ``train.max_skipped_steps``: the longest run of skipped steps allowed.
        start_step: the step the run starts from (after a resume).
        dp_group: the data-parallel group: the real tokens and conversation lengths each rank counts are summed
            over it at a read (None: one rank).
        sources: the names of a mixture's training sources (rows carry their source index), or None.
        media: count image and text tokens (image-text micro-batches' ``num_image_tokens``, ``num_text_tokens``).
    """

    def __init__(self, device: torch.device, log_interval: int, last_step: int, max_skipped_steps: int,
                 start_step: int, dp_group=None, sources: list[str] | None = None, media: bool = False) -> None:
        self.log_interval, self.last_step, self.max_skipped_steps = log_interval, last_step, max_skipped_steps
        # since the last read: trained tokens, skipped steps, the longest run of skipped steps ending in that
        # window (global, the same on every rank), real tokens and sum(s_i^2) of this DP rank's rows; and the
        # current run of skipped steps
        self._counts = torch.zeros(5, dtype=torch.int64, device=device)
        self._skip_run = torch.zeros((), dtype=torch.int64, device=device)
        self._dp_group = dp_group if dp_group is not None and dist.get_world_size(dp_group) > 1 else None
        self._window = [0, 0, 0]     # since the last logging step: trained tokens, real tokens, sum(s_i^2)
        self._logged_step, self._logged_at = start_step, time.perf_counter()
        self._flops = None
        self.sources = sources or []
        self._by_source = [0] * len(self.sources)   # this rank's trained tokens per source since the last read
        self.media = media
        self._media, self._media_window = [0, 0], [0, 0]   # image, text tokens: this rank's since the last read;
        # global since the last logging step

    def set_flops(self, parameters: int, heads_times_head_dim: int, layers: int, world_size: int,
                  device_name: str | None, image_flops: float = 0.0, image_seq_length: int = 1) -> None:
        """Model FLOPs for MFU: ``6 P`` per row token (``P`` the language model's parameters) plus causal attention
        ``6 h l sum(s_i^2)`` (fwd + bwd; ``h`` heads x head dim, ``s_i`` the real conversation lengths), plus
        ``image_flops`` per image (a LLaVA model's vision encoder and projector: :func:`vision_flops_per_image`;
        images counted as image tokens / ``image_seq_length``), against ``world_size`` times the device's dense
        bf16 peak (no MFU on an unknown device or a CPU)."""
        peak = peak_tflops(device_name) if device_name else None
        self._flops = (6.0 * parameters, 6.0 * heads_times_head_dim * layers, peak * 1e12 * world_size,
                       image_flops / image_seq_length) if peak else None

    def start_clock(self, step: int) -> None:
        """Throughput of the next logging step counts from now, ``step`` (the start of the step loop)."""
        self._logged_step, self._logged_at = step, time.perf_counter()
        self._window = [0, 0, 0]
        self._media_window = [0, 0]

    def add(self, trained_tokens: torch.Tensor, skipped: torch.Tensor, lengths: torch.Tensor,
            by_source: list[tuple[int, int]] = (), media: tuple[int, int] = (0, 0)) -> None:
        """Count one step: its trained tokens (int64 scalar), whether it was skipped (bool scalar) and this rank's
        :func:`row_lengths`, on the device; ``by_source``, this rank's ``(source, trained tokens)`` per row (host
        ints, the micro-batches' ``trained_tokens_by_source``); ``media``, this rank's ``(image tokens, text
        tokens)`` (host ints)."""
        for source, tokens in by_source:
            self._by_source[source] += tokens
        self._media = [self._media[0] + media[0], self._media[1] + media[1]]
        skipped = skipped.long()
        self._skip_run = (self._skip_run + 1) * skipped
        self._counts = torch.cat([torch.stack([self._counts[0] + trained_tokens, self._counts[1] + skipped,
                                               torch.maximum(self._counts[2], self._skip_run)]),
                                  self._counts[3:] + lengths])

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is logged: every ``log_interval``-th step and the last."""
        return step % self.log_interval == 0 or step >= self.last_step

    def read(self, state) -> None:
        """Add the counts since the last read to ``state`` (its ``trained_tokens``, ``skipped_steps``,
        ``source_trained_tokens``); one host read, on CUDA after a synchronize (collective over the DP group: every
        rank reads at the same steps).

        Raises:
            FloatingPointError: more than ``max_skipped_steps`` steps in a row were skipped since the last read,
                before anything is saved.
        """
        counts = torch.cat([self._counts, torch.tensor(self._by_source + self._media,
                                                       dtype=torch.int64).to(self._counts.device)])
        if self._dp_group is not None:     # the global counts once (rank 0's), this rank's rows' counts summed
            counts = torch.cat([counts[:3] * int(dist.get_rank(self._dp_group) == 0), counts[3:]])
            dist.all_reduce(counts, group=self._dp_group)
        if counts.device.type == "cuda":
            torch.cuda.synchronize()
        trained, skipped, longest_run, real, squares, *by_source, image, text = counts.tolist()
        self._counts, self._by_source, self._media = torch.zeros_like(self._counts), [0] * len(self.sources), [0, 0]
        self._media_window = [self._media_window[0] + image, self._media_window[1] + text]
        for name, tokens in zip(self.sources, by_source):
            state.source_trained_tokens[name] = state.source_trained_tokens.get(name, 0) + tokens
        state.trained_tokens += trained
        state.skipped_steps += skipped
        self._window = [self._window[0] + trained, self._window[1] + real, self._window[2] + squares]
        if longest_run > self.max_skipped_steps:
            raise FloatingPointError(
                f"step {state.step}: the loss or gradient norm was not finite for {longest_run} steps in a row "
                f"(train.max_skipped_steps={self.max_skipped_steps}); the last checkpoint is intact. "
                "Lower optimizer.lr, check the data (docs/troubleshooting.md), or resume from an earlier checkpoint")

    def record(self, state, result: dict[str, Any], rows: int, seq: int) -> dict[str, Any]:
        """The ``{"kind": "train", ...}`` record of a logging step, after :meth:`read`: ``result`` as Python numbers,
        throughput, packing efficiency and MFU over the steps since the previous logging step (``rows`` rows of
        ``seq`` tokens per step)."""
        now = time.perf_counter()
        steps, seconds = state.step - self._logged_step, now - self._logged_at
        (trained, real, squares), tokens = self._window, steps * rows * seq
        self._logged_step, self._logged_at, self._window = state.step, now, [0, 0, 0]
        media = dict(zip(("image_tokens", "text_tokens"), self._media_window)) if self.media else {}
        image_tokens, self._media_window = self._media_window[0], [0, 0]
        mfu = None
        if self._flops is not None:
            per_token, per_square, peak, per_image_token = self._flops
            mfu = (per_token * tokens + per_square * squares + per_image_token * image_tokens) / seconds / peak
        return {"kind": "train", "step": state.step, **as_python(result),
                "tokens_per_s": tokens / seconds, "trained_tokens_per_s": trained / seconds,
                "packing_efficiency": real / tokens, "mfu": mfu, "consumed_samples": state.consumed_samples,
                "consumed_tokens": state.consumed_samples * seq, "step_time_s": seconds / steps,
                "skipped_steps": state.skipped_steps, "mem_gib": peak_memory_gib(), **source_shares(state), **media}


def vision_flops_per_image(vision_parameters: int, projector_parameters: int, vision, image_seq_length: int) -> float:
    """Training FLOPs (fwd + bwd) of one image through a LLaVA model's vision side: ``6 P_v s`` for the CLIP
    parameters over its ``s = image_seq_length + 1`` positions (class token), full attention ``6 h_v l_v s^2``, and
    ``6 P_p image_seq_length`` for the projector (``vision``: the ``vision:`` section)."""
    s = image_seq_length + 1
    return (6.0 * vision_parameters * s + 6.0 * vision.hidden_size * vision.num_layers * s * s
            + 6.0 * projector_parameters * image_seq_length)


def source_shares(state) -> dict[str, Any]:
    """``total_trained_tokens/<name>`` and ``trained_token_share/<name>`` of each mixture source in ``state`` (none for
    one source or before any trained token)."""
    counts = state.source_trained_tokens
    total = sum(counts.values())
    if not total:
        return {}
    return {**{f"total_trained_tokens/{n}": c for n, c in counts.items()},
            **{f"trained_token_share/{n}": c / total for n, c in counts.items()}}


def as_python(result: dict[str, Any]) -> dict[str, Any]:
    """A step result with its 0-d tensors as Python numbers (a host sync)."""
    out = {k: (v.item() if torch.is_tensor(v) else v) for k, v in result.items()}
    out["trained_tokens"] = int(out["trained_tokens"])
    return out


class MetricsLogger:
    """Write metrics records on the main rank (every method is a no-op on other ranks).

    Args:
        output_dir: run folder; ``metrics.jsonl`` and ``tensorboard/`` are created in it.
        enabled: True on global rank 0 only.
        tensorboard: also write TensorBoard scalars (``torch.utils.tensorboard.SummaryWriter``).
        progress: show a tqdm bar from ``initial_step`` to ``total_steps``.
        restart_step: the step a checkpoint restarts from (-1: a start without one); records past it are set aside
            (:func:`set_aside_records_after`) and hidden in TensorBoard. None: append to the files as they are.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool, progress: bool,
                 initial_step: int, total_steps: int, restart_step: int | None = None) -> None:
        self.enabled, self.set_aside = enabled, 0
        self._file = self._tb = self._bar = self._redirect = self._show_warning = None
        if not enabled:
            return
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.set_aside = set_aside_records_after(out, restart_step) if restart_step is not None else 0
        self._file = open(out / METRICS_FILE, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if restart_step is None else restart_step + 1
            self._tb = SummaryWriter(str(out / "tensorboard"), purge_step=purge)
        if progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step", dynamic_ncols=True)
            self._show_warning, warnings.showwarning = warnings.showwarning, self._warn_through_bar
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def _warn_through_bar(self, message, category, filename, lineno, file=None, line=None) -> None:
        """``warnings.showwarning`` while the bar is shown: the formatted warning through ``tqdm.write``."""
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        if self._bar is None or file not in (None, sys.stderr):
            self._show_warning(message, category, filename, lineno, file, line)
        else:
            self._bar.write(text, file=sys.stderr)

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must have ``kind`` and ``step``) to the JSONL file and its numbers to TensorBoard."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def progress(self, record: dict[str, Any]) -> None:
        """Advance the bar by one step and show loss, lr, grad norm, tokens/s (and GPU memory)."""
        if self._bar is None:
            return
        shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "gnorm": f"{record['grad_norm']:.3f}",
                 "tok/s": f"{record['tokens_per_s']:.0f}"}
        if torch.cuda.is_available():
            shown["mem"] = f"{record['mem_gib']:.1f}G"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Flush and close the file, TensorBoard writer and bar; restore warnings and logging output."""
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
        if self._show_warning is not None and warnings.showwarning == self._warn_through_bar:
            warnings.showwarning = self._show_warning
        self._redirect = self._show_warning = None
        for obj in (self._bar, self._tb, self._file):
            if obj is not None:
                obj.close()
        self._file = self._tb = self._bar = None


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable lines of the run summary dict of ``Trainer.summary``."""
    lines = ["run summary:"]
    for key, value in summary.items():
        if key != "kind":
            lines.append(f"  {key:<24} {value}")
    return "\n".join(lines)

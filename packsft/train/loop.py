"""The training loop: one :class:`Trainer` built from a :class:`~packsft.train.config.Config`, iterating on steps.

Flow of ``Trainer(cfg).run()``:

1. ``init_distributed`` (torchrun variables; gloo on CPU, NCCL on GPU) with the TP/CP/PP sizes;
   DP = world / (TP*CP*PP).
2. Datasets (``packsft.train.data``), model chunks (``build_gpt_stages`` + the hidden-state seam for the fused
   loss; with a ``vision:`` section one LLaVA model, ``packsft.model.vlm.build_llava_model``, its seam on its
   ``language_model``, its micro-batches' ``images`` through the same step), ``Float16Module`` when ``train.bf16``,
   Megatron ``DistributedDataParallel`` (fp32 ``main_grad`` buffers) and ``get_megatron_optimizer``
   (``packsft.train.optim``); the warmup/decay schedule; the stateful training loader.
3. :class:`~packsft.train.checkpointer.Checkpointer` resumes (``checkpoint.resume``), before the loader's first
   ``iter()``, after comparing the checkpoint's recorded ``model``/``lora`` sections with the config
   (:func:`~packsft.train.compat.check_recorded_architecture`); with
   nothing to resume, the model weights of ``checkpoint.init_from`` (an imported HF model) when set. A LoRA run from
   ``init_from`` checkpoints only its adapters and the base's identity; its resume loads the base (``init_from``,
   else the recorded path) after checking the fingerprint, then the adapters and optimizer state.
4. Per step: ``global_batch_size / dp`` micro-batches of one packed row are read, the global trained-token count
   (and under ``loss.normalization: conversation`` the conversation count, each token's loss weighted by one over
   its conversation's trained tokens) is all-reduced over DP x CP, then the micro-batches run forward + backward on
   ``sum(token loss) / count`` through Megatron-Core's schedule (``get_forward_backward_func``: no pipelining,
   1F1B, or interleaved), gradients are reduced by ``finalize_model_grads``, clipped by their TP-aware norm on the
   device, and AdamW steps (skipped on the device when the loss or the norm is not finite).
5. Logging, validation and checkpoints on their periods: the loop asks the
   :class:`~packsft.train.metrics.StepMeter`, the :class:`~packsft.train.validation.Validator` and the
   :class:`~packsft.train.checkpointer.Checkpointer` whether a step is theirs; a final validation (after
   ``train_steps`` only) and checkpoint. With ``train.save_on_sigterm`` a SIGTERM or SIGINT
   (``packsft.train.process_guard``) stops the loop before the next step, on every rank at the same step (a CPU
   all-reduce of the flag per step), and the run ends with a checkpoint.

Pipeline parallelism (``parallel.pipeline_model_parallel_size`` P > 1): the model is this rank's stage
(``build_gpt_stages``: one chunk, or one per virtual stage), each wrapped in Megatron DDP. Every stage reads the
same micro-batches from its own loader (the DP rank is shared by the stages of a replica) and runs them through
:class:`~packsft.train.schedule.Schedule` with a fixed activation shape ``[mbs * L / CP (/ TP with SP), 1, h]``
(every packed row is exactly ``L`` tokens). ``finalize_model_grads`` then reduces over DP x CP, sums
sequence-parallel norms over TP and all-reduces the tied embedding over the first and last stage. The loss is
broadcast from the last stage so every rank logs and decides a skip alike.

Loss scaling: the model's ``TransformerConfig.calculate_per_token_loss`` is set, so Megatron DDP
reduces ``main_grad`` with a plain SUM (``gradient_scaling_factor`` 1, no ``average_in_collective``): each rank
back-propagates ``sum(token loss) / global count`` unscaled and the summed gradient is exactly the gradient of the
global mean. Per step: ``zero_grad_buffer``, forward/backward of every micro-batch (gradients accumulate in
``main_grad``), ``finalize_model_grads`` (all-reduce, or reduce-scatter with the distributed optimizer), then
Megatron's optimizer step as ``packsft.train.optim.megatron_step_skipping_non_finite`` splits it (TP-aware norm,
clipping, Adam on fp32 master weights, copy / all-gather back to the model).
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads

from packsft.data.loader import (
    DataLoaderConfig,
    build_eval_dataloader,
    build_train_dataloader,
    class_path,
)
from packsft.data.mixing import MixedDataset, WeightedMixingSampler, mean_trained_tokens, normalize_weights
from packsft.io import check_writable_dir
from packsft.loss import global_num_trained_conversations, global_num_trained_tokens
from packsft.model.attention import describe_attention
from packsft.model.compile import compile_transformer_layers
from packsft.model.config import check_vocab_size
from packsft.model.gpt import build_gpt_stages, unwrap_model
from packsft.model.lora import apply_lora, enable_input_gradients
from packsft.model.output_head import use_hidden_state_output
from packsft.model.vlm import build_llava_model, language_model
from packsft.sidecar import packing_efficiency
from packsft.train import checkpoint_files as ckpt_files
from packsft.train import process_guard, run_lock
from packsft.train.checkpointer import Checkpointer, TrainState
from packsft.train.config import Config, check_parallel_layout
from packsft.train.config_vision import vlm_config
from packsft.train.data import build_datasets, model_input
from packsft.train.distributed import init_distributed
from packsft.train.grad_clip import optimizer_implementation
from packsft.train.metrics import (
    DISCARDED_FILE,
    MetricsLogger,
    StepMeter,
    as_python,
    format_summary,
    row_lengths,
    vision_flops_per_image,
)
from packsft.train.optim import (
    ParamGroupSchedule,
    build_megatron_optimizer,
    megatron_step_skipping_non_finite,
)
from packsft.train.schedule import Schedule
from packsft.train.validation import Validator


def _nothing_to_train(step: int, stop_at_step: int | None, train_steps: int) -> str:
    """The note of a run that resumes at ``step``, at or past its last step: it trains, validates and saves nothing."""
    if stop_at_step is not None and step >= stop_at_step and step < train_steps:
        return (f"note: nothing to train: the run resumes at step {step} and train.stop_at_step is {stop_at_step} "
                f"(train.stop_at_step=null trains on to train.train_steps={train_steps})")
    return (f"note: nothing to train: the run resumes at step {step} and train.train_steps is {train_steps} "
            "(raise train.train_steps to train on)")


class Trainer:
    """Everything one training process holds; build with a validated config, then :meth:`run`.

    Raises (at construction):
        ValueError: a layout that does not fit the world size, a tokenizer larger than ``model.vocab_size``, CPU
            autocast, a ``logging.output_dir`` that cannot be written, or any data/config error.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        check_writable_dir(cfg.logging.output_dir, "logging.output_dir",   # every rank writes checkpoint files
                           hint="; set logging.output_dir to a writable folder")
        refusal = run_lock.take_run_lock(cfg.logging.output_dir)    # rank 0, before anything in the folder is read
        par = cfg.parallel
        check_parallel_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before init: the message names keys
        self.ctx = init_distributed(par.tensor_model_parallel_size, par.context_parallel_size, par.backend,
                                    seed=cfg.train.seed, pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                                    virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size)
        run_lock.refuse_on_every_rank(refusal)                      # another trainer holds the folder: all ranks exit
        ckpt_files.check_fresh_start(cfg.checkpoint.resume, cfg.logging.output_dir, cfg.checkpoint_dir)
        dp = self.ctx.data_parallel_size
        self.micro_batches = cfg.train.global_batch_size // (cfg.loader.micro_batch_size * dp)
        if cfg.train.autocast_dtype and not torch.cuda.is_available():
            raise ValueError(f"train.autocast_dtype={cfg.train.autocast_dtype!r} needs CUDA (CPU autocast fails in "
                             "Megatron's backward); use null on CPU")
        warn = partial(print, flush=True) if self.ctx.rank == 0 else None
        self.train_set, self.val_sets = build_datasets(cfg, warn=warn)
        check_vocab_size(cfg.model.vocab_size, self.train_set.tokenizer, cfg.data.tokenizer)
        self.pipeline = self.ctx.pipeline_model_parallel_size > 1
        self.chunks = self._build_model()
        self.model = self.chunks[0] if len(self.chunks) == 1 else self.chunks
        self.optimizer = build_megatron_optimizer(self.model, cfg.optimizer, bf16=cfg.train.bf16)
        self.scheduler = ParamGroupSchedule(self.optimizer, cfg.scheduler, cfg.optimizer.lr, cfg.train.train_steps)
        self.train_loader = (self.train_set.train_loader(cfg.loader, self.ctx.dp_rank, dp)
                             if cfg.data.backend == "energon" else
                             build_train_dataloader(self.train_set, self._train_loader_config(),
                                                    dp_rank=self.ctx.dp_rank, dp_size=dp,
                                                    global_batch_size=cfg.train.global_batch_size))
        self.val_loaders = {name: build_eval_dataloader(ds, cfg.loader, dp_rank=self.ctx.dp_rank, dp_size=dp,
                                                        collate_fn=getattr(ds, "collate", None))
                            for name, ds in self.val_sets.items()}   # built once; each pass is a new iter()
        self.checkpointer = Checkpointer(cfg, self.ctx, self.model, self.gpts, self.optimizer, self.scheduler,
                                         self.train_loader)
        self.state = self.checkpointer.start()
        self.schedule = Schedule(self.chunks, cfg, self.ctx)
        self.validator = Validator(cfg.validation, self.val_loaders, self.chunks, self.schedule.totals,
                                   self.schedule.reduce_totals, self.micro_batches, self.ctx.device)
        self.stopped_by = None
        self._stop_group = (dist.new_group(backend="gloo") if cfg.train.save_on_sigterm and self.ctx.world_size > 1
                            and dist.get_backend() != "gloo" else None)
        self._batches = None
        self.meter = StepMeter(self.ctx.device, cfg.logging.log_interval,
                               cfg.train.stop_at_step or cfg.train.train_steps, cfg.train.max_skipped_steps,
                               self.state.step, self.ctx.dp_group,
                               sources=self.train_set.names if isinstance(self.train_set, MixedDataset) else None,
                               media=cfg.vision is not None)

    def _train_loader_config(self) -> DataLoaderConfig:
        """``loader`` as configured; for a mixture of several sources (whose ``loader.sampler`` is ``random``: the
        config's rule), the weighted mixing sampler."""
        if not isinstance(self.train_set, MixedDataset):
            return self.cfg.loader
        sources = self.cfg.data.train_sources()
        weights = normalize_weights([w for _, _, w, _ in sources], self.train_set.names, [p for _, p, _, _ in sources])
        kwargs = {"weights": weights, "samples_per_epoch": self.cfg.data.samples_per_epoch}
        if self.cfg.data.mixture_unit == "trained_tokens":  # (only then: a rows run's kwargs stay what they were)
            kwargs["trained_tokens_per_row"] = [mean_trained_tokens(d, n) for n, d in
                                                zip(self.train_set.names, self.train_set.datasets)]
        return replace(self.cfg.loader, sampler="custom", sampler_class_path=class_path(WeightedMixingSampler),
                       sampler_kwargs=kwargs)

    def _build_model(self) -> list[torch.nn.Module]:
        """This rank's model chunks (one, or one per virtual pipeline stage), each in Megatron's DDP; with a
        ``vision:`` section, the one LLaVA model (checked against ``data.tokenizer``'s processor: ``vlm_config``)."""
        if self.cfg.vision is not None:
            chunks = [build_llava_model(vlm_config(self.cfg.model, self.cfg.vision, self.train_set.image),
                                        max_tokens=self.cfg.loader.micro_batch_size * self.cfg.data.max_seq_len)]
        else:
            chunks = build_gpt_stages(self.cfg.model, sequence_parallel=self.cfg.parallel.sequence_parallel)
        for gpt in chunks:
            if self.cfg.lora.enabled:   # before DDP and the optimizer: only the adapters are trainable
                apply_lora(gpt, self.cfg.lora)
                if self.cfg.model.recompute_granularity == "full":
                    enable_input_gradients(gpt)
            gpt.to(self.ctx.device)
            if self.cfg.train.compile:
                compile_transformer_layers(language_model(gpt))
            if gpt.post_process:
                use_hidden_state_output(language_model(gpt))
        return [self._wrap_megatron(gpt, i) for i, gpt in enumerate(chunks)]

    def _wrap_megatron(self, gpt: torch.nn.Module, chunk: int = 0) -> torch.nn.Module:
        """``DistributedDataParallel(Float16Module(gpt))`` (bf16) or ``DistributedDataParallel(gpt)``, Megatron's."""
        from megatron.core.distributed import DistributedDataParallel as MegatronDDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        gpt.config.calculate_per_token_loss = True        # SUM over DP x CP: the loss is globally normalised
        module = gpt
        if self.cfg.train.bf16:
            gpt.config.bf16 = True
            gpt.config.pipeline_dtype = torch.bfloat16    # activations sent between stages
            module = Float16Module(gpt.config, gpt)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
            average_in_collective=False, use_distributed_optimizer=self.cfg.optimizer.use_distributed_optimizer)
        return MegatronDDP(gpt.config, ddp_config, module, disable_bucketing=chunk > 0)

    @property
    def gpt(self) -> torch.nn.Module:
        """The ``GPTModel`` (or ``LLaVAModel``) of the first chunk (inside DDP when wrapped); all: :attr:`gpts`."""
        return unwrap_model(self.chunks[0])

    @property
    def gpts(self) -> list[torch.nn.Module]:
        """Every model chunk's ``GPTModel`` (one per virtual pipeline stage; one without), or the ``LLaVAModel``."""
        return [unwrap_model(chunk) for chunk in self.chunks]

    # -- checkpoints and validation (Checkpointer, Validator) -------------------------------------------------------
    @property
    def resumed_from(self) -> str | None:
        """The checkpoint folder this run resumed, or None."""
        return self.checkpointer.resumed_from

    @property
    def initialized_from(self) -> str | None:
        """``checkpoint.init_from`` when its weights started the run, or None."""
        return self.checkpointer.initialized_from

    @property
    def lora_base(self) -> dict[str, str] | None:
        """``{"path", "fingerprint"}`` of the base an adapters-only LoRA run trains on, or None."""
        return self.checkpointer.lora_base

    @property
    def last_checkpoint(self) -> Path | None:
        """The folder of this run's last save, or None."""
        return self.checkpointer.last_checkpoint

    def save(self) -> None:
        """Write the checkpoint of the current step (collective)."""
        self.meter.read(self.state)
        self.checkpointer.save(self.state, self.layout())

    def validate(self) -> dict[str, float]:
        """:meth:`Validator.validate <packsft.train.validation.Validator.validate>` at the current step."""
        return self.validator.validate(self.state.step)

    def layout(self) -> dict[str, int | None]:
        """World size and TP/CP/PP/DP sizes (and the virtual pipeline size, None when not interleaved)."""
        ctx = self.ctx
        return {"world_size": ctx.world_size, "tensor_model_parallel_size": ctx.tensor_model_parallel_size,
                "context_parallel_size": ctx.context_parallel_size,
                "pipeline_model_parallel_size": ctx.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": ctx.virtual_pipeline_model_parallel_size,
                "data_parallel_size": ctx.data_parallel_size}

    # -- one step ---------------------------------------------------------------------------------------------------
    def next_micro_batches(self) -> list[dict[str, Any]]:
        """This rank's micro-batches of the next step, CP-sliced, on the device (one ``next()`` each)."""
        if self._batches is None:
            self._batches = iter(self.train_loader)
        ctx = self.ctx
        return [model_input(next(self._batches), ctx.context_parallel_size, ctx.cp_rank, ctx.cp_group, ctx.device,
                            self.cfg.loss.normalization) for _ in range(self.micro_batches)]

    def train_step(self, batches: list[dict[str, Any]]) -> dict[str, Any]:
        """:meth:`step_tensors`, as Python numbers (``loss``, ``grad_norm``, ``lr``, ``trained_tokens``, ``skipped``).

        ``loss`` is the global-batch mean token loss (nats) before the update, or its mean conversation loss under
        ``loss.normalization: conversation``; identical on every rank.
        """
        return as_python(self.step_tensors(batches))

    def step_tensors(self, batches: list[dict[str, Any]]) -> dict[str, Any]:
        """Forward/backward over ``batches``, clip, optimizer and LR step, without a host sync.

        Returns ``loss`` (fp32 scalar), ``grad_norm`` (fp32 scalar), ``trained_tokens`` (int64 scalar) and
        ``skipped`` (bool scalar), all on the device, and ``lr`` (float). A step whose loss or gradient norm is not
        finite is skipped on the device (the fused AdamW kernel's ``found_inf``): parameters and optimizer state
        are left as they were; the LR schedule follows the step number.
        """
        count = global_num_trained_tokens([b["loss_mask"] for b in batches], (self.ctx.dp_cp_group,),
                                          labels=[b["labels"] for b in batches])
        divisor, summed = count, "loss_sum"
        if self.cfg.loss.normalization == "conversation":
            divisor = global_num_trained_conversations([b["conversations"] for b in batches], (self.ctx.dp_cp_group,))
            summed = "conversation_loss_sum"
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self.schedule.run(batches, divisor)
        finalize_model_grads(self.chunks)   # DP x CP, sequence-parallel norms over TP, tied embedding over stages
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for out in outputs:
            loss_sum += out[summed]
        dist.all_reduce(loss_sum, group=self.ctx.dp_cp_group)
        self.schedule.from_last_stage(loss_sum)
        lr = self.optimizer.param_groups[0]["lr"]
        skipped, norm = megatron_step_skipping_non_finite(self.optimizer, loss_sum)
        self.scheduler.step()
        return {"loss": loss_sum / divisor.clamp(min=1), "grad_norm": norm, "lr": lr, "trained_tokens": count,
                "skipped": skipped}

    # -- the loop ---------------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Parameters, parallel layout, batch geometry, data rows, packing efficiency (from the sidecars), and the
        attention kernel and optimizer implementation in use."""
        vision = {}
        if self.cfg.vision is not None:   # a LLaVA model: its vision side's share (MFU counts it per image)
            vision = {"vision_parameters": self._count(self.gpt.vision_model.parameters()),
                      "projector_parameters": self._count(self.gpt.vision_projection.parameters())}
        sidecars = [getattr(d, "sidecar", None) for d in getattr(self.train_set, "datasets", [self.train_set])]
        return {"kind": "summary", "step": self.state.step,
                "parameters": self._count(p for gpt in self.gpts for p in gpt.parameters()), **vision, **self.layout(),
                "micro_batches_per_step": self.micro_batches, "global_batch_size": self.cfg.train.global_batch_size,
                "max_seq_len": self.cfg.data.max_seq_len,
                getattr(self.train_set, "summary_key", "train_rows"): len(self.train_set),
                "validation_rows": {name: len(ds) for name, ds in self.val_sets.items()},
                "train_sources": getattr(self.train_set, "names", None),
                "packing_efficiency": packing_efficiency(*sidecars), "device": str(self.ctx.device),
                "attention": describe_attention(self.cfg.model.attention_backend, self.ctx.device.type,
                                                getattr(torch, self._compute_dtype())),
                "optimizer": optimizer_implementation(self.optimizer),
                "resumed_from": self.resumed_from, "initialized_from": self.initialized_from,
                "lora_base": self.lora_base}

    def _count(self, params) -> int:
        """The parameters of the whole model among ``params`` (this rank's): TP shards summed over the TP group,
        pipeline stages over the PP group; the last stage's copy of a tied embedding left out."""
        params = [p for p in params if not getattr(p, "shared", False)]
        local = sum(p.numel() for p in params
                    if not getattr(p, "tensor_model_parallel", False) and dist.get_rank(self.ctx.tp_group) == 0)
        total = torch.tensor(sum(p.numel() for p in params if getattr(p, "tensor_model_parallel", False)) + local,
                             device=self.ctx.device)   # NCCL reduces device tensors only
        dist.all_reduce(total, group=self.ctx.tp_group)
        if self.pipeline:
            dist.all_reduce(total, group=self.ctx.pp_group)
        return int(total)

    def _compute_dtype(self) -> str:
        """Activations' dtype: ``train.autocast_dtype``, bfloat16 under ``train.bf16``, else ``model.params_dtype``."""
        return self.cfg.train.autocast_dtype or ("bfloat16" if self.cfg.train.bf16 else self.cfg.model.params_dtype)

    def run(self) -> TrainState:
        """Train until ``train.stop_at_step`` or ``train.train_steps``; validate and checkpoint on their periods."""
        cfg, ctx = self.cfg, self.ctx
        last = cfg.train.stop_at_step or cfg.train.train_steps
        restart = self.state.step if self.resumed_from else -1
        logger = MetricsLogger(cfg.logging.output_dir, enabled=ctx.rank == 0, tensorboard=cfg.logging.tensorboard,
                               progress=cfg.logging.progress and self.state.step < last,  # no bar of no step
                               initial_step=self.state.step, total_steps=last, restart_step=restart)
        summary = self.summary()
        m, image = cfg.model, {}
        if cfg.vision is not None:
            size = self.train_set.image.image_seq_length
            image = {"image_flops": vision_flops_per_image(summary["vision_parameters"],
                                                           summary["projector_parameters"], cfg.vision, size),
                     "image_seq_length": size}
        language = summary["parameters"] - summary.get("vision_parameters", 0) - summary.get("projector_parameters", 0)
        self.meter.set_flops(language, m.num_attention_heads * m.head_dim, m.num_layers, ctx.world_size,
                             torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None, **image)
        logger.log(summary)
        logger.message(format_summary(summary))
        if logger.set_aside:
            which = (f"past step {restart} (logged after the checkpoint this run resumes from)" if restart >= 0
                     else "of an earlier run that left no checkpoint")
            logger.message(f"{logger.set_aside} metrics record(s) {which} moved to "
                           f"{Path(cfg.logging.output_dir) / DISCARDED_FILE}")
        if self.validator.at_start(self.state.step):
            logger.log({"kind": "validation", "step": 0, **self.validate()})
        saved_at = None
        started_at = self.state.step
        self.meter.start_clock(started_at)
        if started_at >= last:  # resumed at or past its end: the checkpoint it resumed from already holds it all
            logger.message(_nothing_to_train(started_at, cfg.train.stop_at_step, cfg.train.train_steps))
        installed = cfg.train.save_on_sigterm and process_guard.STOP_SIGNAL.install()
        try:
            while self.state.step < last:
                if cfg.train.save_on_sigterm and self._stop_requested():
                    self.stopped_by = process_guard.STOP_SIGNAL.received or "a stop signal on another rank"
                    break
                self._one_step(logger)
                step = self.state.step
                if self.validator.should_validate(step):
                    logger.log({"kind": "validation", "step": step, **self.validate()})
                if self.checkpointer.should_save(step):
                    self.save()
                    saved_at = step
            if self.stopped_by:
                if saved_at != self.state.step and self.state.step > started_at:
                    self.save()
            elif self.state.step > started_at:   # a stop at train.stop_at_step is not the end: no final validation
                at_end = self.state.step == cfg.train.train_steps
                if at_end and self.validator.at_end(self.state.step):
                    logger.log({"kind": "validation", "step": self.state.step, **self.validate()})
                if (cfg.checkpoint.save_at_end or not at_end) and saved_at != self.state.step:
                    self.save()   # a stop at train.stop_at_step saves: it exists to resume later
        except BaseException:
            logger.close()   # the bar ends its line before the error is printed (it was glued onto the bar)
            raise
        finally:
            if installed:  # also when a step raises: the process keeps no handler of this run
                process_guard.STOP_SIGNAL.uninstall()
        self.meter.read(self.state)
        logger.close()
        return self.state

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM or SIGINT (a MAX all-reduce of a CPU flag over all ranks, gloo)."""
        flag = process_guard.STOP_SIGNAL.received is not None
        if self.ctx.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._stop_group)
        return bool(t.item())

    def _one_step(self, logger: MetricsLogger) -> None:
        """One step; Python numbers (and, on CUDA, a synchronize) only on logging steps."""
        batches = self.next_micro_batches()
        result = self.step_tensors(batches)
        st = self.state
        st.step, st.consumed_samples = st.step + 1, st.consumed_samples + self.cfg.train.global_batch_size
        self.meter.add(result["trained_tokens"], result["skipped"], row_lengths(batches),
                       [pair for b in batches for pair in b.get("trained_tokens_by_source", ())],
                       (sum(b.get("num_image_tokens", 0) for b in batches),
                        sum(b.get("num_text_tokens", 0) for b in batches)))
        if self.meter.should_log(st.step):
            self.meter.read(st)
            record = self.meter.record(st, result, self.cfg.train.global_batch_size, self.cfg.data.max_seq_len)
            logger.log(record)
            logger.progress(record)

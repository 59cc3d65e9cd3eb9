"""LoRA adapters on Megatron-Core's column/row-parallel linears, through peft's ``LoraParallelLinear``.

:func:`apply_lora` injects peft LoRA layers (``peft.inject_adapter_in_model``) into the ``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2`` modules named in :class:`LoraConfig` and freezes everything else.
Per target, with ``r`` the rank (shapes on TP rank ``r_tp`` of ``tp``)::

    ColumnParallelLinear (linear_qkv, linear_fc1): lora_A nn.Linear [r, in] (replicated)
                                                   lora_B ColumnParallelLinear [out/tp, r] (rows, as the base)
    RowParallelLinear (linear_proj, linear_fc2):   lora_A RowParallelLinear [r, in/tp] (columns, as the base)
                                                   lora_B nn.Linear [out, r] (replicated)

``y = base(x) + lora_B(lora_A(dropout(x))) * alpha / r``; ``lora_B`` starts at zero, ``lora_A`` at peft's default
(``kaiming_uniform_(a=sqrt(5))`` of the full ``[r, in]`` matrix, drawn from a generator seeded with
``LoraConfig.seed`` and the module's global name (:func:`adapter_seed`) and sliced, so every TP size and pipeline
layout starts from the same adapters). Adapter weights are fp32.

Checkpoints: :meth:`MegatronLoraLinear.sharded_state_dict` keeps the base weight under its own Megatron key (so an
imported base checkpoint loads into a LoRA model, and resharding works) and adds ``<module>.lora_A.default.weight``
/ ``lora_B.default.weight`` with the TP sharding above (``linear_fc1``'s ``lora_B`` through Megatron's SwiGLU
factory, like the base weight). ``state_dict()`` keys are the base model's plus those two per target.

peft 0.21's own megatron dispatch does not run (it reads a ``fan_in_fan_out`` argument it is never given, leaves
``lora_bias`` unset, and adds the tuple a Megatron linear returns); ``MegatronLoraLinear`` is registered as peft's
custom module for the two Megatron classes and fixes all three. Sequence parallelism: replicated adapter weights
see a sequence shard, so they are marked ``sequence_parallel`` (their gradients summed over TP like the norms').
The ``te`` backend's fused linears are not supported (the training config refuses ``lora.enabled`` with it).
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from packsft.config_rules import FINITE_POSITIVE, POSITIVE_INT, check_fields, distinct_names, in_range, rules

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER = "default"
"""peft's adapter name; it appears in the Megatron keys (``lora_A.default.weight``), not in the PEFT files."""


@dataclass
class LoraConfig:
    """The ``lora:`` section of a training config.

    Attributes:
        enabled: train LoRA adapters on a frozen base model.
        rank: adapter rank ``r`` (> 0).
        alpha: scaling numerator; the update is scaled by ``alpha / rank``.
        dropout: dropout on the adapter input (training only); 0 keeps TP runs equal to TP=1 exactly.
        target_modules: Megatron module names from :data:`LORA_TARGETS`.
        seed: seeds the ``lora_A`` draw of every adapter (with its module name, :func:`adapter_seed`).
    """

    enabled: bool = False
    rank: int = field(default=8, metadata=rules(POSITIVE_INT))
    alpha: float = field(default=16.0, metadata=rules(FINITE_POSITIVE))
    dropout: float = field(default=0.0, metadata=rules(in_range(0, 1)))
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS),
                                      metadata=rules(distinct_names(LORA_TARGETS)))
    seed: int = 0

    def __post_init__(self) -> None:
        """Check the fields (:func:`~packsft.config_rules.check_fields`); raises ``ValueError`` naming
        ``lora.<field>``."""
        check_fields("lora", self)

    @property
    def scaling(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank


def _output(y):
    """The tensor of a Megatron linear's ``(output, bias)`` tuple, or ``y`` itself."""
    return y[0] if isinstance(y, tuple) else y


def _lora_classes():
    from megatron.core import tensor_parallel
    from peft.tuners.lora.tp_layer import LoraParallelLinear

    class MegatronLoraLinear(LoraParallelLinear):
        """peft's ``LoraParallelLinear`` for a Megatron ``ColumnParallelLinear`` / ``RowParallelLinear``.

        Built by peft (custom-module dispatch) with a copy of the base layer's ``TransformerConfig`` (peft sets its
        ``params_dtype`` to fp32). ``forward(x [t, b, in(/tp)])`` returns the base layer's ``(output, bias)`` with
        the adapter's contribution added to ``output``.
        """

        def __init__(self, base_layer, adapter_name, config, **kwargs):
            kwargs.pop("fan_in_fan_out", None)
            super().__init__(base_layer, adapter_name, config=config, backend=tensor_parallel,
                             megatron_config=copy.copy(base_layer.config), fan_in_fan_out=False, **kwargs)
            self._register_state_dict_hook(_drop_base_layer_prefix)
            self.register_load_state_dict_pre_hook(_add_base_layer_prefix)

        def update_layer(self, adapter_name, *args, **kwargs):
            """peft's, after setting the ``lora_bias`` entry its parallel layer forgets (no LoRA bias)."""
            self.lora_bias[adapter_name] = False
            return super().update_layer(adapter_name, *args, **kwargs)

        def forward(self, x: Tensor, *args, **kwargs):
            """Base output plus ``lora_B(lora_A(dropout(x))) * scaling`` (skipped when disabled or merged)."""
            result, bias = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters or self.merged:
                return result, bias
            for name in self.active_adapters:
                if name not in self.lora_A:
                    continue
                lora_a, lora_b = self.lora_A[name], self.lora_B[name]
                h = _output(lora_a(self.lora_dropout[name](x.to(lora_a.weight.dtype))))
                result = result + (_output(lora_b(h)) * self.scaling[name]).to(result.dtype)
            return result, bias

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            """The base layer's sharded state under its own keys, plus the adapters (TP-sharded as the base)."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

            out = self.base_layer.sharded_state_dict(prefix, sharded_offsets, metadata)
            for name in self.lora_A:
                for sub, module in (("lora_A", self.lora_A[name]), ("lora_B", self.lora_B[name])):
                    sub_prefix = f"{prefix}{sub}.{name}."
                    if hasattr(module, "sharded_state_dict"):
                        part = module.sharded_state_dict(sub_prefix, sharded_offsets, metadata)
                    else:
                        part = make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True),
                                                                   sub_prefix, {}, sharded_offsets)
                    if sub == "lora_B" and prefix.endswith("linear_fc1.") and self.base_layer.config.gated_linear_unit:
                        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

                        key = f"{sub_prefix}weight"
                        part[key] = apply_swiglu_sharded_factory(part[key], sharded_offsets)
                    out.update(part)
            return out

    return MegatronLoraLinear


def _drop_base_layer_prefix(module, state_dict, prefix, local_metadata):
    """``state_dict`` hook: ``<prefix>base_layer.weight`` -> ``<prefix>weight`` (the base model's keys)."""
    for key in [k for k in state_dict if k.startswith(prefix + "base_layer.")]:
        state_dict[prefix + key[len(prefix) + len("base_layer."):]] = state_dict.pop(key)
    return state_dict


def _add_base_layer_prefix(module, state_dict, prefix, *args):
    """``load_state_dict`` pre-hook: the inverse of :func:`_drop_base_layer_prefix`."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k[len(prefix):].startswith(
            ("lora_", "base_layer."))]:
        state_dict[prefix + "base_layer." + key[len(prefix):]] = state_dict.pop(key)


def lora_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{module name: LoRA layer}`` of a model :func:`apply_lora` changed (empty for a plain model)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapter_seed(seed: int, name: str) -> int:
    """Seed of the ``lora_A`` initialisation of the adapter at global module name ``name`` (64 bits of SHA-256 of
    ``"<seed>:<name>"``): each adapter draws its own numbers, the same in every pipeline layout."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> dict[str, torch.nn.Module]:
    """Inject LoRA adapters into ``model`` (a ``GPTModel`` of the ``torch`` backend, whose targets are Megatron's
    ``ColumnParallelLinear`` / ``RowParallelLinear``: the training config refuses ``lora.enabled`` with ``te``) in
    place and freeze the base.

    Call after ``build_gpt_model`` (``parallel_state`` initialised) and before building the optimizer and DDP.

    Returns:
        :func:`lora_modules` of the model (``{name: MegatronLoraLinear}``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    from packsft.model.gpt import global_layer_name

    peft_config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                 target_modules=list(lora.target_modules), bias="none")
    cls = _lora_classes()
    peft_config._register_custom_module({ColumnParallelLinear: cls, RowParallelLinear: cls})
    inject_adapter_in_model(peft_config, model)
    modules = lora_modules(model)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, module in modules.items():
        lora_a, lora_b = module.lora_A[ADAPTER], module.lora_B[ADAPTER]
        generator = torch.Generator().manual_seed(adapter_seed(lora.seed, global_layer_name(model, name)))
        full = torch.empty(lora.rank, module.in_features).uniform_(
            -1 / math.sqrt(module.in_features), 1 / math.sqrt(module.in_features), generator=generator)
        with torch.no_grad():
            lora_a.weight.copy_(full.chunk(tp, dim=1)[tp_rank] if module.is_parallel_a else full)
            lora_b.weight.zero_()
        if module.base_layer.config.sequence_parallel:
            replicated = lora_b if module.is_parallel_a else lora_a
            replicated.weight.sequence_parallel = True
    for name, param in model.named_parameters():
        param.requires_grad = ".lora_" in name
    return modules


def enable_input_gradients(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle | None:
    """Make the embedding output of ``model`` (a first-stage ``GPTModel``) require a gradient.

    With the base frozen the first layer's input needs no gradient, so Megatron's full activation recompute (a
    reentrant ``CheckpointFunction``) would return outputs that do not either and the adapters would get none
    (``element 0 of tensors does not require grad``); transformers' ``enable_input_require_grads`` does the same
    for gradient checkpointing. Returns the forward hook's handle (None: not a first stage).
    """
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return None
    return embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def lora_parameters(model: torch.nn.Module) -> Iterable[torch.nn.Parameter]:
    """The adapter parameters (those :func:`apply_lora` left trainable)."""
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def merge_lora(model: torch.nn.Module) -> None:
    """Fold every adapter into its base weight (peft's ``merge``) and put the plain base layers back, in place.

    Afterwards ``model`` is a plain ``GPTModel`` whose ``state_dict`` the HF export reads; each TP rank merges its
    own shard (``W_r += B_r A`` for column-, ``W_r += B A_r`` for row-parallel layers).
    """
    for name, module in lora_modules(model).items():
        module.merge()
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, module.get_base_layer())


def read_lora_config(path) -> LoraConfig | None:
    """The ``lora:`` section of a training YAML (e.g. the trainer's resolved ``config.yaml``) when enabled, else None.

    Raises:
        ValueError: naming unknown ``lora.*`` keys.
    """
    from pathlib import Path

    from packsft.model.config import config_from_dict

    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        return None
    import yaml

    section = (yaml.safe_load(path.read_text()) or {}).get("lora") or {}
    lora = config_from_dict(LoraConfig, section, f"{path} lora")
    return lora if lora.enabled else None

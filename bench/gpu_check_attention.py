"""Attention backends' agreement on CUDA (part of ``bench/gpu_check.sh``; one process, one GPU).

Rows of the printed table (``check | max abs diff | tolerance | ok``):

* ``torch-thd-vs-dense-<dtype>``: packsft's ``TorchCoreAttention`` on a packed THD row (conversations of 100, 156
  and 256 tokens, GQA 8 heads / 2 groups, head dim 64) against one dense SDPA call with an explicit block-diagonal
  causal mask, fp32 and bf16.
* ``gpt-logits-cuda-vs-cpu``: the tiny packsft GPT (``torch`` backend, fp32, TF32 off) on the same packed row on
  CUDA and on CPU with the same weights.
* ``te-thd-vs-torch-bf16``: TransformerEngine's ``TEDotProductAttention`` (THD) against ``TorchCoreAttention``, or
  ``skipped`` when TransformerEngine is not installed.

    python bench/gpu_check_attention.py            # prints the table; exit status 1 if a check fails
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LENGTHS = [100, 156, 256]
HEADS, GROUPS, HEAD_DIM = 8, 2, 64


def _qkv(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(LENGTHS)
    q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(t, GROUPS, HEAD_DIM, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


def _dense_reference(q, k, v):
    """One SDPA over the whole row with a block-diagonal causal bool mask, fp32; returns ``[t, np*hn]``."""
    doc = torch.repeat_interleave(torch.arange(len(LENGTHS), device="cuda"), torch.tensor(LENGTHS, device="cuda"))
    pos = torch.arange(len(doc), device="cuda")
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    qf, kf, vf = (x.float().permute(1, 0, 2)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True)
    return out[0].permute(1, 0, 2).flatten(1)


def _psp(device="cuda"):
    from packsft.data.context_parallel import make_packed_seq_params

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return make_packed_seq_params(cu, max(LENGTHS))


def _config(dtype):
    from packsft.model.config import ModelConfig

    cfg = ModelConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, ffn_hidden_size=1024, num_attention_heads=HEADS,
                      num_query_groups=GROUPS, vocab_size=1024, max_position_embeddings=512,
                      params_dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    return cfg.to_transformer_config(tp=1, cp=1)


def check_torch_vs_dense(dtype) -> float:
    from megatron.core.transformer.enums import AttnMaskType

    from packsft.model.attention import TorchCoreAttention

    attn = TorchCoreAttention(_config(dtype), 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(dtype)
    out = attn(q, k, v, None, packed_seq_params=_psp())
    return (out.float() - _dense_reference(q, k, v)).abs().max().item()


def check_te_vs_torch() -> float | str:
    try:
        import transformer_engine  # noqa: F401 - megatron's extension module imports even without TE (mocked)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
    except ImportError as err:
        return f"skipped ({type(err).__name__}: TransformerEngine not installed)"
    from megatron.core.transformer.enums import AttnMaskType

    from packsft.model.attention import TorchCoreAttention

    cfg = _config(torch.bfloat16)
    te = TEDotProductAttention(cfg, 1, AttnMaskType.padding_causal, "self")
    q, k, v = _qkv(torch.bfloat16)
    got = te(q, k, v, None, attn_mask_type=AttnMaskType.padding_causal, packed_seq_params=_psp())
    ref = TorchCoreAttention(cfg, 1, AttnMaskType.causal, "self")(q, k, v, None, packed_seq_params=_psp())
    return (got.reshape(ref.shape).float() - ref.float()).abs().max().item()


def _tiny_gpt():
    from packsft.model.config import ModelConfig
    from packsft.model.gpt import build_gpt_model

    cfg = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2,
                      vocab_size=4096, max_position_embeddings=512)
    return cfg, build_gpt_model(cfg).eval()


def cpu_reference(folder: Path) -> None:
    """The tiny GPT's logits on CPU (run with CUDA hidden: the path CI tests) from ``folder/inputs.pt``."""
    from packsft.train.distributed import destroy_distributed, init_distributed

    init_distributed(backend="gloo")
    inputs = torch.load(folder / "inputs.pt", weights_only=True)
    _, model = _tiny_gpt()
    missing, unexpected = model.load_state_dict(inputs["state_dict"], strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):   # only megatron's non-tensor entries
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        logits = model(inputs["tokens"], inputs["position_ids"], None, packed_seq_params=_psp("cpu")).float()
    torch.save(logits, folder / "logits.pt")
    destroy_distributed()


def check_gpt_cuda_vs_cpu() -> float:
    """The tiny GPT on CUDA against the same weights on CPU in a process that sees no GPU.

    A CPU model in a process with CUDA is not Megatron's CPU path (its RoPE moves ``inv_freq`` to the current CUDA
    device), so the reference runs as CI does: ``CUDA_VISIBLE_DEVICES=""``, gloo, the CPU workarounds applied.
    """
    torch.manual_seed(0)
    cfg, model = _tiny_gpt()
    model = model.cuda()
    t = sum(LENGTHS)
    tokens = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(1))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    psp = _psp()
    with torch.no_grad():
        got = model(tokens.cuda(), position_ids.cuda(), None, packed_seq_params=psp).float().cpu()
    state = {k: v.cpu() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.save({"state_dict": state, "tokens": tokens, "position_ids": position_ids}, folder / "inputs.pt")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        subprocess.run([sys.executable, __file__, "--cpu-reference", str(folder)], check=True, timeout=60,
                       env={**env, "CUDA_VISIBLE_DEVICES": ""})
        ref = torch.load(folder / "logits.pt", weights_only=True)
    return (got - ref).abs().max().item()


def main() -> int:
    from packsft.train.distributed import destroy_distributed, init_distributed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(backend="nccl")
    checks = [("torch-thd-vs-dense-fp32", lambda: check_torch_vs_dense(torch.float32), 1e-5),
              ("torch-thd-vs-dense-bf16", lambda: check_torch_vs_dense(torch.bfloat16), 2e-2),
              ("gpt-logits-cuda-vs-cpu", check_gpt_cuda_vs_cpu, 1e-3),
              ("te-thd-vs-torch-bf16", check_te_vs_torch, 2e-2)]
    failed = False
    print(f"{'check':<26}{'max abs diff':>14}{'tolerance':>11}  ok")
    for name, fn, tol in checks:
        try:
            value = fn()
        except Exception as err:  # a broken check is reported in the table, the others still run
            value = f"error: {type(err).__name__}: {err}"[:120]
        if isinstance(value, str):
            failed |= value.startswith("error")
            print(f"{name:<26}{value}")
            continue
        ok = value <= tol
        failed |= not ok
        print(f"{name:<26}{value:>14.3e}{tol:>11.0e}  {'yes' if ok else 'NO'}")
    destroy_distributed()
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cpu-reference"]:
        cpu_reference(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())

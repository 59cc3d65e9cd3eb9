#!/usr/bin/env bash
# Device check on ONE CUDA GPU (about 3-5 minutes; each part is capped so the whole stays under 8 minutes):
#   1. training smoke test: tools/train.py under torchrun with NCCL, tiny model, real packed rows, 20 steps;
#   2. fused-loss memory benchmark: bench/loss.py --device cuda (bf16, t=4096 and 16384, v=131072);
#   3. attention backends' agreement on CUDA: bench/gpu_check_attention.py.
# Prints a short table (also written to $OUT/gpu_check.txt when OUT is set, else out/gpu_check/).
#
# Inputs (the GPU image has PyTorch and transformers, not megatron-core or torchdata):
#   .whl/          wheels installed with --no-deps into /tmp/site when present (see docs/parallelism.md)
#   GPU_CHECK_DATA a folder with chat/gsm8k_test.messages.jsonl and tokenizers/smollm2-135m-instruct
#                  (default ../shared/data, else .gpu_check_data/ carried next to the repo files)
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RESULTS=${OUT:-$REPO/out/gpu_check}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
mkdir -p "$RESULTS"
TABLE=$RESULTS/gpu_check.txt
: >"$TABLE"

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
DATA=${GPU_CHECK_DATA:-}
if [ -z "$DATA" ]; then
  if [ -d ../shared/data ]; then DATA=$(cd ../shared/data && pwd); else DATA=$REPO/.gpu_check_data; fi
fi
row() { printf '%-30s %-8s %s\n' "$1" "$2" "$3" | tee -a "$TABLE"; }

echo "== environment"
python3 - <<'EOF' 2>&1 | tee "$RESULTS/environment.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
import megatron.core, torchdata
print("megatron-core", megatron.core.__version__, "torchdata", torchdata.__version__)
EOF

echo "== 1. training smoke test (NCCL, 1 GPU)"
head -n 200 "$DATA/chat/gsm8k_test.messages.jsonl" >"$WORK/gsm8k.jsonl"
TOK=$DATA/tokenizers/smollm2-135m-instruct
timeout 60 python3 tools/pack_megatron_sft_jsonl.py --input "$WORK/gsm8k.jsonl" --output "$WORK/rows.jsonl.packed" \
  --tokenizer "$TOK" --max-seq-length 1024 --histogram "" >"$RESULTS/pack.log" 2>&1
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 tools/train.py \
  --config configs/tiny_cpu.yaml data.train_path="$WORK/rows.jsonl.packed" data.tokenizer="$TOK" \
  data.max_seq_len=1024 model.max_position_embeddings=1024 data.split_validation_size=0 validation.val_period=0 \
  validation.val_at_end=false parallel.backend=nccl train.train_steps=20 checkpoint.save_interval=10 \
  logging.output_dir="$WORK/train" logging.tensorboard=false logging.progress=false >"$RESULTS/train.log" 2>&1
rc=$?
python3 - "$WORK/train/metrics.jsonl" "$rc" <<'EOF' | tee -a "$TABLE"
import json, sys
path, rc = sys.argv[1], int(sys.argv[2])
try:
    recs = [json.loads(line) for line in open(path)]
except OSError:
    recs = []
train = [r for r in recs if r.get("kind") == "train"]
ok = rc == 0 and len(train) == 20 and train[-1]["loss"] < train[0]["loss"]
detail = (f"loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}, {train[-1]['tokens_per_s']:.0f} tokens/s, "
          f"mem {train[-1]['mem_gib']} GiB" if train else "no metrics")
print(f"{'train-smoke-nccl':<30} {'ok' if ok else 'FAIL':<8} rc={rc}; {detail}")
EOF

echo "== 2. fused-loss memory benchmark (CUDA)"
timeout 120 python3 bench/loss.py --device cuda --dtype bf16 --t 4096 16384 --v 131072 --h 4096 \
  --chunk-sizes 1024 4096 >"$RESULTS/loss_bench.txt" 2>&1
rc=$?
cat "$RESULTS/loss_bench.txt"
row "loss-bench-cuda" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; table in loss_bench.txt"

echo "== 3. attention backends on CUDA"
timeout 90 python3 bench/gpu_check_attention.py >"$RESULTS/attention.txt" 2>&1
rc=$?
cat "$RESULTS/attention.txt"
row "attention-agreement" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; table in attention.txt"

echo "== summary"
cat "$TABLE"
rm -rf "$WORK"
! grep -q FAIL "$TABLE"

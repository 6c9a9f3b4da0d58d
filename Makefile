# Two-command quickstart: `make demo` and `make test`. Each creates .venv when absent
# and installs what it needs; a stamp file re-installs when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jxformers needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.stamp-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	@touch $@

$(VENV)/.stamp-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $@ $(VENV)/.stamp-run

demo: $(VENV)/.stamp-run
	$(BIN)/jxformers demo --workdir runs/demo

test: $(VENV)/.stamp-dev
	$(BIN)/python -m pytest -n 2 -q

bench: $(VENV)/.stamp-run
	$(BIN)/python scripts/bench_attention.py --out docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .jax_cache

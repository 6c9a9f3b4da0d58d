# Two-command quickstart: `make demo` and `make test`. Each creates .venv when absent
# and installs what it needs; a stamp file re-installs when pyproject.toml changes.
# `make test PYTHON=python3.13 VENV=.venv-3.13` tests under another interpreter in its own
# venv; PYTEST_ARGS adds pytest arguments (.ci/run passes --fast-subset for the newest Python).
# `make lint`: ruff (lint and the format check) and basedpyright,
# configured in pyproject.toml, the same checks .pre-commit-config.yaml runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test test-multidevice lint baseline docs bench clean check-venv

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

# A venv made by another Python than $(PYTHON) would be used silently: refuse it.
check-venv: | $(BIN)/python
	@want=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	have=$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	[ "$$want" = "$$have" ] || { echo "$(VENV) holds Python $$have but PYTHON=$(PYTHON) is Python $$want:" \
	  "pass VENV=.venv-$$want (or run make clean)"; exit 1; }

demo: check-venv $(VENV)/.stamp-run
	$(BIN)/jxformers demo --workdir runs/demo

test: check-venv $(VENV)/.stamp-dev
	$(BIN)/python -m pytest -n 2 -q $(PYTEST_ARGS)

# The tests `make test` leaves out (pyproject's addopts): sharded training on 8 simulated
# devices and runs of two jax processes, each in processes of its own (about 5 minutes on
# 2 cores). CI runs them after `make test`.
test-multidevice: check-venv $(VENV)/.stamp-dev
	$(BIN)/python -m pytest -n 2 -q -m multidevice $(PYTEST_ARGS)

LINT_PATHS := jxformers tests scripts

# basedpyright's baseline is locked here as CI locks it, so a baseline that would shrink fails
# locally too (not only in CI); `make baseline` rewrites it after errors are fixed.
lint: check-venv $(VENV)/.stamp-dev
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/basedpyright --pythonpath $(BIN)/python --baselinemode=lock

baseline: check-venv $(VENV)/.stamp-dev
	$(BIN)/basedpyright --pythonpath $(BIN)/python --baselinemode=auto

# `make docs`: the documentation site (mkdocs.yml, docs/) built strictly into site/; CI runs it.
$(VENV)/.stamp-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[docs]'
	@touch $@

docs: check-venv $(VENV)/.stamp-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q

bench: $(VENV)/.stamp-run
	$(BIN)/python scripts/bench_attention.py --out docs/benchmarks.md

clean:
	rm -rf $(VENV) .venv-3.* .pytest_cache .hypothesis .jax_cache site

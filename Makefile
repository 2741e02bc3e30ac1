# The two commands a fresh machine needs: `make demo` and `make test`. Each runs its set-up
# first, which installs only what is missing (a few milliseconds when nothing is):
#   setup      the product (PostgreSQL, plpython3u, pgvector, the venv): no compiler needed
#   setup-dev  the product plus its [dev] extra and the lab (lab/; g++ and Python headers for hnswlib)
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: setup setup-dev test lint demo demo-stop clean-db fresh-debian test-infinity

setup:
	@bash scripts/setup.sh

setup-dev:
	@bash scripts/setup.sh --dev
	@if [ -f scripts/setup-browser.sh ]; then bash scripts/setup-browser.sh; fi

lint: setup-dev
	$(BIN)/ruff check service plpython lab tests
	$(BIN)/ruff format --check service plpython lab tests
	$(BIN)/mypy

# The suite in $(TEST_WORKERS) pytest-xdist workers, each with its own throwaway clusters
# (tests/conftest.py); `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 3

# Bytecode compiled once first: where PYTHONDONTWRITEBYTECODE is set (this project's CI
# machines set it in their environment) every process the suite starts (servers, CLI runs,
# MCP over stdio) compiled the modules it imports again, about 0.3 s of CPU a server start.
# Python still reads .pyc files the variable forbids it to write; compileall skips those
# already up to date. Only a speed-up: a tree it cannot write fails nothing ("-").
test: setup-dev lint
	-$(BIN)/python -m compileall -q service plpython lab
	$(BIN)/pytest -q -n $(TEST_WORKERS)

demo: setup
	@bash scripts/demo.sh

demo-stop: setup
	@bash scripts/demo.sh stop

clean-db: setup
	$(BIN)/poimen-memory db stop || true

# The remote-embedding and rerank-protocol tests against a real Infinity server, installed
# into its own venv (not part of `make test`; skipped with the reason where it cannot be).
test-infinity: setup-dev
	@bash scripts/infinity.sh

# Contributors: the README's two commands in minimal Debian 12 and 13 roots (docs/fresh-debian.md).
fresh-debian:
	@bash scripts/fresh-debian.sh

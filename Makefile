# The two commands a fresh machine needs: `make demo` and `make test`. Both run `make setup`
# first, which installs only what is missing (well under a second when nothing is).
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: setup test lint unit demo demo-stop clean-db

setup:
	@bash scripts/setup.sh

lint: setup
	$(BIN)/ruff check service plpython tests
	$(BIN)/mypy

test: setup lint
	$(BIN)/pytest -q

demo: setup
	@bash scripts/demo.sh

demo-stop: setup
	@bash scripts/demo.sh stop

clean-db: setup
	$(BIN)/poimen-memory db stop || true

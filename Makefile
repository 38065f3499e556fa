# kvstore developer targets. `make test` is what CI runs; `make demo` is the quick start.
# `make test` runs pytest through scripts/pytest_redis.py: against $KVSTORE_TEST_REDIS when
# set, else a throwaway redis-server on a free loopback port when one is installed, else it
# says how many Redis tests were skipped.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvstore-installed

.PHONY: setup demo test lint fmt proto bench clean

setup: $(STAMP)

# The CPU build of torch 2.13.0 is installed first so nothing pulls a multi-GB CUDA build;
# nixl-cu12 comes after torch because it declares `torch`.
$(STAMP): pyproject.toml setup.py kvstore/core/_native.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,engine]'
	$(BIN)/pip install -q 'nixl-cu12>=1.5' || echo "nixl-cu12 unavailable: ucx:// disabled"
	touch $(STAMP)

proto: setup
	$(BIN)/python scripts/gen_proto.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

fmt: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: setup
	$(BIN)/python scripts/gen_proto.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy kvstore clients
	$(BIN)/python scripts/pytest_redis.py -q

demo: setup
	$(BIN)/python examples/demo.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) build *.egg-info

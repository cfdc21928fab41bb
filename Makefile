# Every target sets up its own environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test clean

# The main job on the embedded default: make (once) and compile the demo pair, then generate with it.
demo: $(STAMP)
	$(BIN)/specbuild demo

test: $(STAMP)
	$(BIN)/python -m pytest

$(STAMP): pyproject.toml runtime/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch (the compiler's, never the runtime's) first, pinned: an unpinned torch pulls a multi-GB CUDA build.
	# Here 2.13.0 resolves to a CPU build from local wheels; on public PyPI it is a CUDA build too, so set
	# TORCH_INDEX=https://download.pytorch.org/whl/cpu there (make TORCH_INDEX=... test).
	$(BIN)/pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	# cpu: the CPU onnxruntime, which the test extra's onnxruntime-genai needs too (a GPU install: README, GPU).
	$(BIN)/pip install -q -e "./runtime[serve]" -e ".[cpu,test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .cache

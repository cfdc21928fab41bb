# Every target sets up its own environment in .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

# The main job on the embedded default: make (once) and compile the demo pair, then generate with it.
demo: $(STAMP)
	$(BIN)/specbuild demo

test: $(STAMP)
	$(BIN)/python -m pytest

$(STAMP): pyproject.toml runtime/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e "./runtime[serve]" -e ".[test]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .cache

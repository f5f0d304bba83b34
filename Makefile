# Everything runs from a virtual environment inside the repo (.venv), made on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# where torch comes from: pip's own choice by default (PyPI's build of 2.13.0 is the CUDA one, several GB);
# `make run TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU-only build
TORCH_INDEX ?=
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "moemesh needs Python 3.11 or newer; $(PY) is " + sys.version.split()[0] + " (give another: make run PY=python3.12)")'
	@$(PY) -m venv $(VENV) || { echo "could not make a virtual environment with $(PY) (on Debian and Ubuntu: apt install python3-venv)" >&2; exit 1; }
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e '.[worker,test]'
	touch $(STAMP)

setup: $(STAMP)

# The main job: serve the built-in model (moemesh/demo_model, trained on the stdlib) at http://127.0.0.1:8000,
# coordinator, two pipeline stages and the gateway all on this machine. Ctrl-C stops everything.
run: $(STAMP)
	$(BIN)/moemesh serve --pp 2

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/moemesh make-tiny-model --arch mixtral --preset bench --out models/bench-mixtral
	$(BIN)/moemesh bench model --model models/bench-mixtral --batch 1,8,32,64 --new 64 --prompt-len 32 --threads 1

clean:
	rm -rf $(VENV) models .pytest_cache

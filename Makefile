# The README's two commands: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install lint clean gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned, so that no later resolution can pull a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/trainmesh run jobs/tiny-cpu.yaml

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# On a machine with a CUDA GPU and trainmesh importable (no venv is made: use the GPU's torch).
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PY) bench/gpu_check.py --append bench/RESULTS.md

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs mlflow.db

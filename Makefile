# The README's two commands: `make demo` and `make test` (`make test-all`: the whole suite, CI's).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all quick bench-smoke install lint clean gpu-check

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
	@echo "trainmesh is installed in $(VENV): run 'source $(VENV)/bin/activate' for the commands in README's 'Using it'"

# Everyday work (<= 5 minutes on 2 cores): every test that starts no Ray but those marked full, and
# the Ray tests marked everyday (one real-rank case per axis, one recovery, the demo: tests/tiers.py).
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "everyday or not (cluster or ray_apart or full)"

# Everything (CI runs this): every parity case, the fault matrix, the tracking-server outage, submit.
test-all: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# Local iteration: everything that starts no Ray cluster.
quick: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not cluster and not gpu"

# Every benchmark at its smallest size, so none can rot unnoticed (not timings: see bench/).
bench-smoke: $(STAMP)
	$(BIN)/python bench/planner.py
	TRITON_INTERPRET=1 $(BIN)/python bench/kernels.py --smoke
	$(BIN)/python bench/build.py --preset tiny --ranks 2
	$(BIN)/python bench/tensor_parallel.py --preset tiny --steps 1 --seq-len 32 --batch 2
	$(BIN)/python bench/pipeline.py --steps 1
	$(BIN)/python bench/overhead.py --steps 2 --warmup 1 --skip-ray-train
	$(BIN)/python bench/recovery.py --trials 1 --skip-ray-train --ckpt-mib 8 --modes warm
	$(BIN)/python bench/soak.py --minutes 1 --every-min 0.5
	$(BIN)/python bench/moe.py --tokens 256 --dim 64 --expert-ffn 64 --reps 2
	$(BIN)/python bench/data_parallel.py --preset tiny --steps 1 --seq-len 32
	$(BIN)/python bench/context_parallel.py --preset tiny --steps 1 --seq-len 256
	$(BIN)/python bench/first_step.py --layers 2 --repeat 1
	$(BIN)/python bench/data_wait.py --steps 3 --step-s 0.01 --global-batch 8

# On a machine with a CUDA GPU and trainmesh importable (no venv is made: use the GPU's torch).
gpu-check:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(PY) bench/gpu_check.py --append bench/history/journal.md

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs mlflow.db mlruns site

# Two commands for a fresh clone:  make demo  (train the CPU demo on the embedded corpus; run again, it continues the
# demo it finds; FRESH=1 starts it over)  and  make test
# (the linter and the fast tests, about a minute); make test-all runs every test (CI, 5-9 minutes)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-all experiments-deps gpu-check clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# the tests' extras: pytest, pytest-xdist (one test process per core), ruff (the linter), and wandb
# (optional for users: wandb_log=true), so its tests run
$(VENV)/.test-installed: $(VENV)/.installed Makefile
	$(PY) -m pip install -q pytest pytest-xdist ruff==0.17.6 wandb scipy matplotlib
	touch $@

experiments-deps: $(VENV)/.installed  # what the sweeps' report needs beside the core: scipy (its tests), matplotlib
	$(PY) -m pip install -q scipy matplotlib

demo: $(VENV)/.installed
	test -f data/shakespeare/meta.json || $(PY) prepare_data.py
	$(PY) train.py configs/demo.py $(if $(FRESH),--overwrite=true,$(if $(wildcard runs/demo),--resume=true))
	$(PY) sample.py --ckpt runs/demo --prompt "ROMEO:" --max_new_tokens 100

test: $(VENV)/.test-installed  # the linter, then every test not marked slow: one process per core, one thread each
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto -m "not slow"
	@echo "(the tests marked slow were left out, 'deselected' above: make test-all runs them)"

test-all: $(VENV)/.test-installed  # the linter, then every test, the slow ones first (conftest.py)
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadgroup

gpu-check: $(VENV)/.installed  # on a CUDA machine: bench, torchrun stop/resume, sampling; one summary
	$(PY) -m tools.gpu_check

clean:
	rm -rf $(VENV) data/*/ runs/

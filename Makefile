# Two commands for a fresh clone:  make demo  (train the CPU demo on the embedded corpus)  and  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test gpu-check clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt pytest
	touch $@

demo: $(VENV)/.installed
	test -f data/shakespeare/meta.json || $(PY) prepare_data.py
	$(PY) train.py configs/demo.py --overwrite=true
	$(PY) sample.py --ckpt runs/demo --prompt "ROMEO:" --max_new_tokens 100

test: $(VENV)/.installed
	$(PY) -m pytest -q

gpu-check: $(VENV)/.installed  # on a CUDA machine: bench, torchrun stop/resume, sampling; one summary
	$(PY) gpu_check.py

clean:
	rm -rf $(VENV) data/*/ runs/

# Two commands for a fresh clone:  make demo  (train the CPU demo on the embedded corpus)  and  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt pytest
	touch $@

demo: $(VENV)/.installed
	$(PY) -c "import torch, model; m = model.GPT(model.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_embd=64, n_head=2, residual='block_attnres')); x = torch.randint(0, 256, (2, 64)); loss = m(x, x)[1]; loss.backward(); print(f'smoke check: loss {loss.item():.3f}')"

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) data/*/ runs/

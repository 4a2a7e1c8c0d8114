# make test / make demo from a fresh clone: create (or reuse) a virtual environment and install what is needed.
# torch is pinned first so that no other requirement pulls a different (multi-GB CUDA) build on a CPU box.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test test-all demo clean

$(STAMP): setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

test-all: $(STAMP)
	$(PY) -m pytest -q -m "" tests

demo: $(STAMP)
	$(PY) pretrain_composer.py --model kimi-k2.5 --dry-run
	$(PY) pretrain_composer.py --model tiny --mock-data --train-iters 30 --micro-batch-size 4 \
		--global-batch-size 8 --lr 3e-3 --log-interval 5
	$(VENV)/bin/torchrun --nproc-per-node 2 pretrain_composer.py --model tiny --mock-data --train-iters 10 \
		--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 4 --global-batch-size 8 \
		--lr 3e-3 --log-interval 5

clean:
	rm -rf $(VENV) build *.egg-info

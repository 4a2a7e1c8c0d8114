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

DEMO := runs/demo
TINY_TRAIN := --model tiny --mock-data --micro-batch-size 8 --global-batch-size 16 --lr 1e-2 --lr-warmup-iters 5 \
	--min-lr 1e-3 --log-interval 10 --eval-interval 25 --eval-iters 2 --save $(DEMO)/ckpt --save-interval 25 \
	--tensorboard-dir $(DEMO)/tb

demo: $(STAMP)
	$(PY) pretrain_composer.py --model kimi-k2.5 --dry-run
	rm -rf $(DEMO)
	# tiny K2.5 (MLA, MoE, MTP) pretraining under TP2 + SP on two gloo ranks
	$(VENV)/bin/torchrun --nproc-per-node 2 pretrain_composer.py $(TINY_TRAIN) --train-iters 50 \
		--tensor-model-parallel-size 2 --sequence-parallel
	# resume the same run under plain data parallelism: weights and optimizer state are resharded
	$(VENV)/bin/torchrun --nproc-per-node 2 pretrain_composer.py $(TINY_TRAIN) --train-iters 60 --load $(DEMO)/ckpt
	@echo "TensorBoard events: $(DEMO)/tb  (tensorboard --logdir $(DEMO)/tb)"

clean:
	rm -rf $(VENV) build *.egg-info

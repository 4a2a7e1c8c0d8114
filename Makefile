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
DEMO_DATA := $(DEMO)/data
DEMO_TOKENIZER := $(DEMO_DATA)/tokenizer
# the standard library as a code corpus, a 4096-id BPE tokenizer trained on it, 256-token samples
DEMO_DATA_FLAGS := --data-path $(DEMO_DATA)/stdlib_text_document --split 98,1,1 --tokenizer-type HFTokenizer \
	--tokenizer-model $(DEMO_TOKENIZER) --seq-length 256
TINY_TRAIN := --model tiny $(DEMO_DATA_FLAGS) --micro-batch-size 8 --global-batch-size 16 --lr 1e-2 \
	--lr-warmup-iters 5 --min-lr 1e-3 --log-interval 10 --eval-interval 10 --eval-iters 2 --save $(DEMO)/ckpt \
	--save-interval 25 --tensorboard-dir $(DEMO)/tb

demo: $(STAMP)
	$(PY) pretrain_composer.py --model kimi-k2.5 --dry-run
	rm -rf $(DEMO)
	# data: corpus -> tokenizer -> Megatron indexed dataset (offline, from this machine's Python)
	$(PY) tools/build_corpus.py --output $(DEMO_DATA)/stdlib.jsonl
	$(PY) tools/train_tokenizer.py --input $(DEMO_DATA)/stdlib.jsonl --vocab-size 4096 --output $(DEMO_TOKENIZER)
	$(PY) tools/preprocess_data.py --input $(DEMO_DATA)/stdlib.jsonl --output-prefix $(DEMO_DATA)/stdlib \
		--tokenizer-type HFTokenizer --tokenizer-model $(DEMO_TOKENIZER) --workers 2 --append-eod
	# tiny K2.5 (MLA, MoE, MTP) pretraining on it under TP2 + SP on two gloo ranks
	$(VENV)/bin/torchrun --nproc-per-node 2 pretrain_composer.py $(TINY_TRAIN) --train-iters 50 \
		--tensor-model-parallel-size 2 --sequence-parallel
	# resume the same run under plain data parallelism: weights and optimizer state are resharded
	$(VENV)/bin/torchrun --nproc-per-node 2 pretrain_composer.py $(TINY_TRAIN) --train-iters 60 --load $(DEMO)/ckpt
	$(PY) -c "from tests.tb import scalars; v = scalars('$(DEMO)/tb')['lm loss validation']; \
		print('validation lm loss by iteration:', {k: round(x, 3) for k, x in sorted(v.items())}); \
		assert v[max(v)] < v[min(v)], 'validation loss did not fall'"
	@echo "TensorBoard events: $(DEMO)/tb  (tensorboard --logdir $(DEMO)/tb)"

clean:
	rm -rf $(VENV) build *.egg-info

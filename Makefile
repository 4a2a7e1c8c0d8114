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
# the standard library as a code corpus and a 4096-id BPE tokenizer trained on it
DEMO_TOKENS := --tokenizer-type HFTokenizer --tokenizer-model $(DEMO_TOKENIZER)
DEMO_PRETRAIN_DATA := --data-path $(DEMO_DATA)/stdlib_text_document $(DEMO_TOKENS)
DEMO_SFT_DATA := --data-path $(DEMO_DATA)/sft.jsonl $(DEMO_TOKENS)
TORCHRUN := $(VENV)/bin/torchrun --nproc-per-node 2

demo: $(STAMP)
	WORLD_SIZE=512 $(PY) pretrain_composer.py @examples/kimi-k2.5/pretrain-32k.args --dry-run
	rm -rf $(DEMO)
	# data: corpus -> tokenizer -> Megatron indexed dataset, and coding conversations for SFT (offline)
	$(PY) tools/build_corpus.py --output $(DEMO_DATA)/stdlib.jsonl
	$(PY) tools/train_tokenizer.py --input $(DEMO_DATA)/stdlib.jsonl --vocab-size 4096 --output $(DEMO_TOKENIZER)
	$(PY) tools/preprocess_data.py --input $(DEMO_DATA)/stdlib.jsonl --output-prefix $(DEMO_DATA)/stdlib \
		--tokenizer-type HFTokenizer --tokenizer-model $(DEMO_TOKENIZER) --workers 2 --append-eod
	$(PY) tools/build_sft_data.py --input $(DEMO_DATA)/stdlib.jsonl --output $(DEMO_DATA)/sft.jsonl
	# stage 1, pretrain at 256 tokens: TP2 + SP until iteration 40, then resumed under DP2 (resharded)
	$(TORCHRUN) pretrain_composer.py @examples/tiny/pretrain.args $(DEMO_PRETRAIN_DATA) \
		--tensor-model-parallel-size 2 --sequence-parallel --exit-interval 40
	$(TORCHRUN) pretrain_composer.py @examples/tiny/pretrain.args $(DEMO_PRETRAIN_DATA)
	# stage 2, extend to 1024 tokens with YaRN under context parallelism 2; MTP attached, self-distilled
	$(TORCHRUN) pretrain_composer.py @examples/tiny/extend.args $(DEMO_PRETRAIN_DATA)
	# stage 3, SFT on packed coding conversations
	$(TORCHRUN) pretrain_composer.py @examples/tiny/sft.args $(DEMO_SFT_DATA)
	$(PY) -c "from megatron_ext.training.tensorboard import scalars; \
		v = scalars('$(DEMO)/tb/pretrain')['lm loss validation']; \
		print('pretrain validation lm loss:', {k: round(x, 3) for k, x in sorted(v.items())}); \
		assert v[max(v)] < v[min(v)], 'validation loss did not fall'; \
		e = scalars('$(DEMO)/tb/extend'); s = scalars('$(DEMO)/tb/sft'); \
		print('extend (CP2, 1024 tokens) validation lm loss:', {k: round(x, 3) for k, x in sorted(e['lm loss validation'].items())}); \
		print('sft validation lm loss:', {k: round(x, 3) for k, x in sorted(s['lm loss validation'].items())}); \
		a = s['mtp_1 top1 agreement']; print('MTP-1 top-1 agreement with the main head, end of SFT:', round(a[max(a)], 3))"
	# evaluation: codebase NLL of the SFT model on code it never saw (this repository's agentic environment), and
	# a few tasks of the built-in suite mined from pinned PyPI sdists (fetched and mined once, then cached)
	$(PY) tools/run_eval.py nll --load $(DEMO)/ckpt/sft --tokenizer-model $(DEMO_TOKENIZER) --repo megatron_ext/env \
		--out $(DEMO)/nll.json --quiet
	$(PY) tools/run_eval.py --tasks builtin:pypi-demo --agent local:$(DEMO)/ckpt/sft \
		--serve-arg=--tokenizer-model --serve-arg=$(DEMO_TOKENIZER) --passes 1 --out $(DEMO)/eval
	@echo "TensorBoard events: $(DEMO)/tb  (tensorboard --logdir $(DEMO)/tb)"

clean:
	rm -rf $(VENV) build *.egg-info

r"""Serve a Megatron checkpoint (or a Hugging Face one, through the importer) over an OpenAI-compatible API.

    python tools/serve.py --load CKPT --use-checkpoint-args --port 8000 [--tokenizer-model DIR]
    python tools/serve.py --hf-dir /data/Kimi-K2.5 --port 8000        # imported on the fly into --save or a temp dir
    torchrun --nproc-per-node 2 tools/serve.py --load CKPT --use-checkpoint-args --tensor-model-parallel-size 2 \
        --sequence-parallel                # rank 0 serves HTTP; every rank holds its shard and generates with it
    curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 1}'
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ext  # noqa: E402,F401
from megatron_ext.arguments import ArgumentError, parse_args  # noqa: E402


def _serve_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--hf-dir", default=None, help="serve a Hugging Face checkpoint (imported first)")
    g.add_argument("--served-model-name", default=None, help="the name /v1/models reports")


def build_service(args):
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.inference.server import ModelParallelServing, ModelService
    from megatron_ext.training.checkpointing import load_checkpoint, load_weights
    from megatron_ext.training.initialize import initialize_distributed
    from megatron_ext.training.step import build_model

    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    if args.load:
        load_checkpoint(args, model, None, None)

    def reload(path: str):
        load_weights(args, model, path)

    tokenizer = None
    if args.tokenizer_model:
        from megatron_ext.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    peers = ModelParallelServing() if ModelParallelServing.needed() else None
    return ModelService(InferenceEngine(model[0]), args.served_model_name or args.model, tokenizer=tokenizer,
                        reload=reload, peers=peers)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--hf-dir")
    pre.add_argument("--save")
    known, _ = pre.parse_known_args(argv)
    if known.hf_dir and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("error: --hf-dir imports on one process; under torchrun convert first (tools/convert_checkpoint.py "
              "import --hf-dir HF --save CKPT) and serve with --load CKPT --use-checkpoint-args", file=sys.stderr)
        return 2
    if known.hf_dir:
        from megatron_ext.convert.streaming import import_hf
        from megatron_ext.training.initialize import destroy

        target = known.save or tempfile.mkdtemp(prefix="serve_import_")
        import_hf(known.hf_dir, target)
        destroy()
        argv += ["--load", target, "--use-checkpoint-args"]
    try:
        args = parse_args(argv + ["--mock-data"], description=__doc__, extra=(_serve_args,))
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.finetune = True  # serving needs weights only
    import signal

    import torch.distributed as dist

    from megatron_ext.inference.server import serve
    from megatron_ext.training.initialize import destroy

    service = build_service(args)
    if service.peers is not None and dist.get_rank() != 0:
        service.peers.follow(service)  # until rank 0 stops
        destroy()
        return 0
    server = serve(service, args.host, args.port)
    if service.peers is not None:
        service.peers.keep_alive(service)
    print(f"serving {args.model} on http://{args.host}:{server.server_address[1]}", flush=True)
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)  # delivered to sigwait below, not to a default handler
    try:
        signal.sigwait(signals)
    finally:
        server.shutdown()
        if service.peers is not None:
            try:
                service.peers.stop(service)
            except RuntimeError:  # the launcher may have stopped the other ranks already
                pass
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())

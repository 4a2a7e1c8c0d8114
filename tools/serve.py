r"""Serve a Megatron checkpoint (or a Hugging Face one, through the importer) over an OpenAI-compatible API.

    python tools/serve.py --load CKPT --use-checkpoint-args --port 8000 [--tokenizer-model DIR]
    python tools/serve.py --hf-dir /data/Kimi-K2.5 --save /data/k25-mg --port 8000    # imported once, then reused
    python tools/serve.py --hf-dir /data/Kimi-K2.5 --port 8000    # imported into a temporary directory, removed on exit
    torchrun --nproc-per-node 2 tools/serve.py --load CKPT --use-checkpoint-args --tensor-model-parallel-size 2 \
        --sequence-parallel                # rank 0 serves HTTP; every rank holds its shard and generates with it
    curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 1}'
    curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "n": 4, "stream": true}'   # SSE chunks
    curl localhost:8000/v1/reload -d '{"load": "NEW_CKPT"}'  # validated; on failure the old weights keep serving
    # SGLang's native shapes (what megatron_ext/rl/remote.py speaks, to this server or to SGLang itself):
    curl localhost:8000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8, "n": 2,
        "sampling_seed": 7}, "return_logprob": true, "return_routed_experts": true}'
    curl localhost:8000/update_weights_from_disk -d '{"model_path": "NEW_CKPT", "weight_version": "12"}'
    curl localhost:8000/get_model_info        # weight_version, MoE layers / top-k for routing replay
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ext  # noqa: E402,F401
from megatron_ext.arguments import ArgumentError, parse_args  # noqa: E402
from megatron_ext.convert.hf import ConversionError  # noqa: E402
from megatron_ext.training.checkpointing import CheckpointError  # noqa: E402


def _serve_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--hf-dir", default=None, help="serve a Hugging Face checkpoint (imported first)")
    g.add_argument("--served-model-name", default=None, help="the name /v1/models reports")
    g.add_argument("--random-weights", action="store_true",
                   help="serve a randomly initialised model (smoke tests, demos) instead of a checkpoint; /health and "
                        "/v1/models then report random_weights: true. Without --load (or --hf-dir) this flag is "
                        "required, and a --load that holds no checkpoint is an error even with --load-optional")
    g.add_argument("--speculation", choices=("auto", "always"), default="auto",
                   help="requests with \"speculative\": true (MTP drafting): 'auto' decodes a batch plainly (the "
                        "same tokens) when drafting is not expected to pay at its size (draft, verify and plain "
                        "step costs measured once per batch-size bucket, acceptance observed so far; the decision "
                        "is logged when it changes); 'always' drafts whenever asked")
    g.add_argument("--inference-max-seq-length", type=int, default=None,
                   help="context (prompt + generated tokens) to serve; default: the model's trained context "
                        "(--max-position-embeddings). Beyond it only for YaRN models: the YaRN factor is raised so "
                        "that --original-max-position-embeddings x factor covers it (YaRN's inference-time "
                        "extension; the model never trained at that factor, so quality inside the trained context "
                        "can shift a little: compare codebase NLL, tools/run_eval.py nll, at both settings)")


def prepare_hf_checkpoint(hf_dir: str, save: str | None, log=print):
    """Import `hf_dir` for serving. Returns (checkpoint root, cleanup function or None).

    With `save` the import goes there and is reused by later starts while `hf_dir` is unchanged (same config,
    file names, sizes and times); a `save` holding anything else is refused. Without it the import goes to a
    temporary directory ($TMPDIR) that the cleanup function removes (main() runs it on exit, on errors and on
    SIGTERM/SIGINT)."""
    from megatron_ext.convert.streaming import imported_from, import_hf, source_fingerprint
    from megatron_ext.training.initialize import destroy

    if save:
        common = imported_from(save)
        if common is not None:
            if common.get("source_fingerprint") == source_fingerprint(hf_dir):
                log(f"reusing the import of {hf_dir} in {save}")
                return save, None
            raise ConversionError(f"--save {save} holds an import of {common.get('converted_from')} that does not "
                                  f"match --hf-dir {hf_dir} (another model, or changed since): choose another "
                                  f"--save, or remove {os.path.join(save, 'release')} to import again")
        import_hf(hf_dir, save)
        destroy()
        return save, None
    target = tempfile.mkdtemp(prefix="serve_import_")
    log(f"importing {hf_dir} into {target} (removed on exit; pass --save DIR to keep the import and reuse it)")

    def cleanup():
        shutil.rmtree(target, ignore_errors=True)

    try:
        import_hf(hf_dir, target)
        destroy()
    except BaseException:
        cleanup()
        raise
    return target, cleanup


def _exit_on_signal(signum, frame):
    """SIGTERM/SIGINT before serving starts (import, model build): unwind, so that cleanups run."""
    raise SystemExit(128 + signum)


def build_service(args):
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.inference.reload import CheckpointReload
    from megatron_ext.inference.server import ModelParallelServing, ModelService
    from megatron_ext.training.checkpointing import load_checkpoint
    from megatron_ext.training.initialize import initialize_distributed
    from megatron_ext.training.step import build_model

    if args.inference_max_seq_length is not None:
        from megatron_ext.training.stages import serving_context

        args.arch, note = serving_context(args.arch, args.inference_max_seq_length)  # StageError: a ValueError
        args.max_position_embeddings = args.arch.max_position_embeddings
        args.rotary_scaling_factor = args.arch.rotary_scaling_factor
        print(note, flush=True)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    if args.load:
        load_checkpoint(args, model, None, None)

    tokenizer = None
    if args.tokenizer_model:
        from megatron_ext.data.tokenizers import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    peers = ModelParallelServing() if ModelParallelServing.needed() else None
    service = ModelService(InferenceEngine(model[0]), args.served_model_name or args.model, tokenizer=tokenizer,
                           reload=CheckpointReload(args, model[0], log=print), peers=peers,
                           speculation=args.speculation)
    service.random_weights = getattr(args, "random_weights", False)
    return service


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
    cleanup = None
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if known.hf_dir:
            try:
                target, cleanup = prepare_hf_checkpoint(known.hf_dir, known.save)
            except (ConversionError, CheckpointError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            argv += ["--load", target, "--use-checkpoint-args"]
        return _serve(argv)
    finally:
        if cleanup is not None:
            cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _weights_problem(args) -> str | None:
    """Random weights are served only when asked for: a missing --load (or one without a checkpoint) is not."""
    from megatron_ext.training.checkpointing import read_tracker

    if args.random_weights:
        return "--random-weights and --load exclude each other: drop one" if args.load else None
    if not args.load:
        return ("no weights to serve: pass --load CKPT (or --hf-dir HF), or --random-weights to serve a randomly "
                "initialised model")
    if read_tracker(args.load) is None:
        return (f"--load {args.load} holds no checkpoint (no latest_checkpointed_iteration.txt); --load-optional "
                "does not apply to serving: fix the path, or pass --random-weights (without --load) to serve a "
                "randomly initialised model")
    return None


def _port_problem(host: str, port: int) -> str | None:
    """A port already in use, found before the model is built."""
    import socket

    if port == 0:
        return None
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((host, port))
    except OSError as e:
        return f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port (0: any free one)"
    finally:
        probe.close()
    return None


def _serve(argv: list) -> int:
    from megatron_ext.training.stages import StageError

    try:
        args = parse_args(argv + ["--mock-data"], description=__doc__, extra=(_serve_args,))
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.finetune = True  # serving needs weights only
    args.save = None  # --save is where --hf-dir imports to (done by now); a server writes no checkpoint
    problem = _weights_problem(args) or _port_problem(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    from megatron_ext.inference.server import serve
    from megatron_ext.training.initialize import destroy

    try:
        service = build_service(args)
    except StageError as e:
        print(f"error: {e}", file=sys.stderr)
        destroy()
        return 2
    if service.peers is not None and dist.get_rank() != 0:
        service.peers.follow(service)  # until rank 0 stops
        destroy()
        return 0
    try:
        server = serve(service, args.host, args.port)
    except OSError as e:  # taken between the check above and now
        print(f"error: --host {args.host} --port {args.port}: cannot listen there ({e.strerror}); pick another "
              "--port (0: any free one)", file=sys.stderr)
        destroy()
        return 2
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

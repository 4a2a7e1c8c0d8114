"""Hugging Face <-> Megatron checkpoints for DeepSeek-V3 / Kimi K2 / Kimi K2.5 / Kimi Linear, streamed tensor by tensor.

    python tools/convert_checkpoint.py import --hf-dir HF --save CKPT [--dtype bf16] [--no-mtp]
    python tools/convert_checkpoint.py export --load CKPT --hf-dir OUT [--mtp] [--dtype bf16] [--overwrite]

An imported checkpoint is a Megatron-Core dist checkpoint (CKPT/release) that pretrain_composer.py loads at any
tensor/pipeline/expert-parallel layout with `--load CKPT` (weights only; training starts at iteration 0). Parallel
flags given to `import` are checked against the model (e.g. EP must divide the expert count) but do not change the
file: the format is layout-free. Export reads any checkpoint written by pretrain_composer.py, whatever its layout.
Neither command deletes what it did not write: export refuses a non-empty --hf-dir without --overwrite (and then
replaces only its own files), import refuses a --save that already holds a checkpoint without --overwrite.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import megatron_ext  # noqa: E402,F401
from megatron_ext.arguments import ArgumentError  # noqa: E402
from megatron_ext.convert.hf import ConversionError  # noqa: E402
from megatron_ext.training.checkpointing import CheckpointError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face safetensors -> Megatron dist checkpoint")
    imp.add_argument("--hf-dir", required=True, help="directory with config.json and safetensors shards")
    imp.add_argument("--save", required=True, help="Megatron checkpoint root to write (CKPT/release)")
    imp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                     help="checkpoint dtype (default: the HF weights' dtype; bf16 for FP8/INT4 weights)")
    imp.add_argument("--no-mtp", action="store_true",
                     help="leave out the MTP layers even when the checkpoint has them (absent ones are always "
                          "left out, as in models saved by transformers)")
    imp.add_argument("--overwrite", action="store_true",
                     help="import even if --save already holds a checkpoint: replaces its release/ and points its "
                          "tracker at the import (training iter_* directories are kept)")
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--expert-model-parallel-size"):
        imp.add_argument(flag, type=int, default=1, help="validated against the model; the file is layout-free")
    exp = sub.add_parser("export", help="Megatron checkpoint -> Hugging Face safetensors")
    exp.add_argument("--load", required=True, help="Megatron checkpoint root (its latest checkpoint is used)")
    exp.add_argument("--hf-dir", required=True, help="output directory")
    exp.add_argument("--mtp", action="store_true", help="also write the MTP layers (DeepSeek-V3 layout)")
    exp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None, help="default: as saved")
    exp.add_argument("--max-shard-size-mb", type=int, default=4096, help="target size of each output shard")
    exp.add_argument("--overwrite", action="store_true",
                     help="write into a non-empty --hf-dir, replacing only the files this export writes (shards, "
                          "index, config.json); other files stay")
    exp.add_argument("--skip-checkpoint-checksums", action="store_true",
                     help="check only the sizes of the checkpoint's files, not their checksums (saves a full read)")
    args = parser.parse_args(argv)

    from megatron_ext.convert.streaming import export_hf, import_hf, validate_layout
    from megatron_ext.training.initialize import destroy

    try:
        if args.command == "import":
            summary = import_hf(args.hf_dir, args.save, dtype=args.dtype, no_mtp=args.no_mtp,
                                overwrite=args.overwrite)
            validate_layout(args.hf_dir, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                            args.expert_model_parallel_size)
        else:
            summary = export_hf(args.load, args.hf_dir, mtp=args.mtp, dtype=args.dtype,
                                max_shard_bytes=args.max_shard_size_mb << 20, overwrite=args.overwrite,
                                checksums=not args.skip_checkpoint_checksums)
    except (ConversionError, CheckpointError, ArgumentError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        destroy()
    print(f"peak RSS: {summary['peak_rss_mib']:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

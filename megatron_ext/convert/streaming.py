"""Streaming HF <-> Megatron conversion: one tensor in memory at a time, whatever the model size.

Import writes a Megatron-Core `dist_checkpointing` (torch_dist) checkpoint directly through
`torch.distributed.checkpoint` with a planner whose items are the chunks a one-rank save would write; each chunk
is read (and dequantised) from its safetensors shard only when the writer asks for it. The result is an ordinary
reshardable checkpoint: pretrain_composer.py loads it at any TP/PP/EP (`release/`, loaded as weights only).
Export reads chunks back with `dist_checkpointing.load` one output shard at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import resource
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from tqdm import tqdm

from megatron_ext import atomic
from megatron_ext.arguments import parse_args
from megatron_ext.convert import kimi_linear
from megatron_ext.convert.hf import ConversionError, ShardedCheckpoint, config_from_preset, preset_from_config, read_config
from megatron_ext.convert.mapping import MTP_DUPLICATES, HFLayout, Piece, enumerate_pieces
from megatron_ext.models.presets import ModelPreset
from megatron_ext.models.provider import model_provider
from megatron_ext.training import checkpointing
from megatron_ext.training.initialize import initialize_distributed

RELEASE = "release"
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
_QUANT_SUFFIXES = (".weight_scale_inv", ".weight_packed", ".weight_scale", ".weight_shape")
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def peak_rss_mib() -> float:
    """This process's peak resident memory. VmHWM belongs to the process image (ru_maxrss would include a
    parent's peak: Linux carries it across fork and exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _meta_model(arch: ModelPreset, extra_flags=()):
    # The local spec whatever the machine: its checkpoint keys are TE's (models/te_layout.py), its names ours.
    args = parse_args(["--model", "tiny", "--mock-data", "--transformer-impl", "local", *extra_flags], world_size=1,
                      base_arch=arch)
    initialize_distributed(args)
    with torch.device("meta"):
        model = model_provider(args)
    return args, model


class _LazyPlanner(SavePlanner):
    """Plans the given write items and produces each item's data only when the writer reaches it."""

    def __init__(self, items: list[WriteItem], resolve):
        self.items, self.resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=True):
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        return self.resolve(write_item)


def source_fingerprint(hf_dir: str, dtype: str | None = None, no_mtp: bool = False) -> str:
    """Identifies an import's input without reading the weights: config.json's bytes, every file's name, size and
    modification time, and the options that change the output."""
    digest = hashlib.sha256()
    with open(os.path.join(hf_dir, "config.json"), "rb") as f:
        digest.update(f.read())
    for name in sorted(os.listdir(hf_dir)):
        st = os.stat(os.path.join(hf_dir, name))
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    digest.update(f"dtype={dtype} no_mtp={no_mtp}".encode())
    return digest.hexdigest()


def imported_from(save: str) -> dict | None:
    """The common state of the complete imported checkpoint `save/release` (None: there is none)."""
    if checkpointing.read_tracker(save) != RELEASE:
        return None
    ckpt = checkpointing.checkpoint_dir(save, RELEASE)
    checkpointing.verify_checkpoint(ckpt)
    return torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)


def _check_import_target(save: str, overwrite: bool, log):
    """Refuse to repoint a directory's tracker away from what it holds unless told to (`overwrite`)."""
    try:
        tag = checkpointing.read_tracker(save)
    except checkpointing.CheckpointError as e:
        raise ConversionError(f"--save {save}: {e}") from None
    if tag is None:
        return
    if tag == RELEASE:
        what = f"an imported checkpoint ({checkpointing.checkpoint_dir(save, RELEASE)})"
    else:
        what = (f"training checkpoints (latest: iteration {tag}); importing would point "
                f"{checkpointing.TRACKER} at the import, so --load {save} would no longer resume training")
    if not overwrite:
        raise ConversionError(f"--save {save} already holds {what}: choose an empty directory, or pass "
                              "--overwrite to replace the import there")
    log(f"--overwrite: {save} holds {what}; the import replaces {RELEASE}/ and becomes the latest"
        + ("" if tag == RELEASE else " (the iter_* directories are kept; training with --save there refuses to "
                                     "overwrite them unless --override-save)"))


def import_hf(hf_dir: str, save: str, dtype: str | None = None, no_mtp: bool = False, overwrite: bool = False,
              log=print) -> dict:
    """Convert a HF checkpoint under `hf_dir` into `save/release`. Returns a summary with the peak RSS.

    MTP layers (DeepSeek-V3's extra decoder layers after the last one) are converted when their tensors are
    present; a checkpoint saved by `transformers` keeps num_nextn_predict_layers in config.json but holds no MTP
    tensors, and imports without them. `no_mtp` skips present ones. A NaN or Inf weight stops the import, naming
    the tensor. `save` must not already hold a checkpoint unless `overwrite`."""
    _check_import_target(save, overwrite, log)
    full, text = read_config(hf_dir)
    model_type = full["model_type"]
    arch = preset_from_config(text, os.path.join(hf_dir, "config.json"))
    ckpt = ShardedCheckpoint.open(hf_dir)
    layout = HFLayout.detect(ckpt.files, arch.num_layers, model_type)
    skipped = sorted(n for n in ckpt.files if n.startswith(_VISION_PREFIXES))
    if skipped:
        log(f"skipping {len(skipped)} vision-tower / projector tensors (the text backbone is converted)")
    mtp_prefixes = tuple(f"{layout.root}layers.{arch.num_layers + k}." for k in range(arch.mtp_num_layers))
    mtp_present = sorted(n for n in ckpt.files if mtp_prefixes and n.startswith(mtp_prefixes))
    if arch.mtp_num_layers and (no_mtp or not mtp_present):
        if mtp_present:
            log(f"--no-mtp: skipping the {arch.mtp_num_layers} MTP layer(s) ({len(mtp_present)} tensors)")
            skipped += mtp_present
        else:
            log(f"config.json declares {arch.mtp_num_layers} MTP layer(s) (num_nextn_predict_layers) but "
                f"{hf_dir} holds none of their tensors (transformers' save_pretrained drops them): importing "
                "without MTP layers")
        arch = arch.replace(mtp_num_layers=0)
    args, model = _meta_model(arch)
    pieces, objects = enumerate_pieces(model, layout)
    if arch.mtp_num_layers:
        log(f"converting {arch.mtp_num_layers} MTP layer(s)")

    # Every HF tensor must be used, a duplicate we know, a quantisation companion, or vision: else it is unknown.
    wanted = {p.hf_name for p in pieces}
    dupes = {f"{layout.root}layers.{arch.num_layers + k}.{d}" for k in range(arch.mtp_num_layers)
             for d in MTP_DUPLICATES}
    for name, filename in sorted(ckpt.files.items()):
        base = name
        for suffix in _QUANT_SUFFIXES:
            if name.endswith(suffix):
                base = name[: -len(suffix)] + ".weight"
        if base in wanted or name in dupes or name in skipped or name.endswith("rotary_emb.inv_freq"):
            continue
        raise ConversionError(f"unknown tensor {name} in {os.path.join(hf_dir, filename)}: not part of a "
                              f"{model_type} model with this config.json")
    target_dtype = _target_dtype(dtype, ckpt, pieces)
    for p in pieces:
        if ckpt.file_of(p.hf_name) is None:
            raise ConversionError(f"tensor {p.hf_name} is missing from {hf_dir} (needed for Megatron {p.key})")
        want = _hf_expected_shape(p, arch)
        got = ckpt.shape(p.hf_name)
        if got != want:
            raise ConversionError(f"tensor {p.hf_name} in {os.path.join(hf_dir, ckpt.file_of(p.hf_name))} "
                                  f"has shape {got}, expected {want} from config.json")
    pieces.sort(key=lambda p: (ckpt.file_of(p.hf_name), p.key))  # one shard open at a time while writing
    ckpt.close()

    items, sources = [], {}
    for p in pieces:
        piece_dtype = p.dtype if p.dtype == torch.float32 and "expert_bias" in p.key else target_dtype
        index = MetadataIndex(p.key, torch.Size(p.offset))
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(p.offset), sizes=torch.Size(p.shape)),
            properties=TensorProperties(dtype=piece_dtype), size=torch.Size(p.global_shape))))
        sources[(p.key, tuple(p.offset))] = (p, piece_dtype)
    blobs = {}
    for obj in objects:
        buf = io.BytesIO()
        torch.save([obj.data], buf)
        blobs[obj.unique_key] = buf
        items.append(WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO))

    shards = tqdm(total=len(ckpt.shard_names), desc="shards", unit="shard", disable=None)
    seen_files = set()

    failures: list[ConversionError] = []

    def resolve(item: WriteItem):
        try:
            return _resolve(item)
        except ConversionError as e:  # torch wraps it in a CheckpointException with a remote-style traceback
            failures.append(e)
            raise

    def _resolve(item: WriteItem):
        if item.type == WriteItemType.BYTE_IO:
            return blobs[item.index.fqn]
        p, piece_dtype = sources[(item.index.fqn, tuple(item.index.offset))]
        filename = ckpt.file_of(p.hf_name)
        if filename not in seen_files:
            seen_files.add(filename)
            shards.update(1)
        value = ckpt.weight(p.hf_name, piece_dtype)
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise ConversionError(f"tensor {p.hf_name} in {os.path.join(hf_dir, filename)} has {bad} NaN/Inf "
                                  f"value(s) of {value.numel()}: the source checkpoint is corrupt")
        value = _pad_vocab(value, p)
        return value.reshape(p.shape).contiguous()

    final = os.path.join(save, RELEASE)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # One file per chunk: torch's writer keeps every tensor of a file alive until the file is complete, so a
        # single file would hold the whole model in memory.
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1)
        writer.fs = checkpointing.checksum_file_system()  # the manifest's CRC-32s come from the bytes written
        try:
            dcp.save({}, storage_writer=writer, planner=_LazyPlanner(items, resolve), no_dist=True)
        except (Exception, CheckpointException):  # CheckpointException is a BaseException
            if failures:
                raise failures[0] from None
            raise
        common = {"iteration": 0, "format_version": checkpointing.FORMAT_VERSION, "release": True,
                  "args": {**checkpointing.serializable_args(args), "no_save_optim": True},
                  "layout": {}, "optimizer_parts": 0, "opt_param_scheduler": None,
                  "converted_from": os.path.abspath(hf_dir),
                  "source_fingerprint": source_fingerprint(hf_dir, dtype, no_mtp)}
        torch.save(common, os.path.join(tmp, "common.pt"))
        with open(os.path.join(tmp, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
        checkpointing.publish(save, tmp, final, RELEASE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shards.close()
        ckpt.close()
    summary = {"tensors": len(pieces), "dtype": str(target_dtype), "peak_rss_mib": peak_rss_mib(),
               "mtp_layers": arch.mtp_num_layers,
               "largest_shard_mib": max(os.path.getsize(os.path.join(hf_dir, f)) for f in ckpt.shard_names) / 2**20}
    log(f"imported {len(pieces)} tensors into {final} ({target_dtype}); peak RSS {summary['peak_rss_mib']:.1f} MiB")
    return summary


def _target_dtype(dtype: str | None, ckpt: ShardedCheckpoint, pieces: list[Piece]) -> torch.dtype:
    if dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    embedding = next(p for p in pieces if p.key == "embedding.word_embeddings.weight")
    stored = ckpt.get(embedding.hf_name).dtype  # never quantised in any release format
    return stored if stored in (torch.float32, torch.bfloat16, torch.float16) else torch.bfloat16


def _hf_expected_shape(p: Piece, arch: ModelPreset) -> tuple[int, ...]:
    if p.key in _VOCAB_KEYS:
        return (arch.vocab_size,) + p.data_shape[1:]
    return p.data_shape


def _pad_vocab(value: torch.Tensor, p: Piece) -> torch.Tensor:
    """Megatron pads the vocabulary to a multiple of 128 x TP; the padding rows start at zero."""
    rows = p.data_shape[0]
    if p.key in _VOCAB_KEYS and value.shape[0] < rows:
        value = torch.cat([value, value.new_zeros(rows - value.shape[0], *value.shape[1:])])
    return value


def export_hf(load: str, hf_dir: str, mtp: bool = False, dtype: str | None = None,
              max_shard_bytes: int = 4 << 30, overwrite: bool = False, checksums: bool = True, log=print) -> dict:
    """Write the Megatron checkpoint under `load` (its latest, any layout) as HF safetensors shards.

    The files are written into a fresh staging directory and moved into `hf_dir` only when all are complete.
    A non-empty `hf_dir` is refused unless `overwrite`, and even then only the files of this export (shards, index,
    config.json) are replaced; nothing else in `hf_dir` is touched."""
    try:
        existing = atomic.existing_entries(hf_dir)
    except NotADirectoryError as e:
        raise ConversionError(f"--hf-dir: {e}") from None
    if existing and not overwrite:
        shown = ", ".join(existing[:5]) + (f" and {len(existing) - 5} more" if len(existing) > 5 else "")
        raise ConversionError(f"--hf-dir {hf_dir} is not empty ({shown}): choose a new directory, or pass "
                              "--overwrite to replace the files this export writes (other files are kept)")
    tag = checkpointing.read_tracker(load)
    if tag is None:
        raise ConversionError(f"no checkpoint under {load} ({checkpointing.TRACKER} missing)")
    ckpt_dir = checkpointing.checkpoint_dir(load, tag)
    checkpointing.verify_checkpoint(ckpt_dir, checksums=checksums)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    arch = ModelPreset(**common["args"]["arch"])
    if arch.attention_residuals:
        raise ConversionError(f"{ckpt_dir} uses --attention-residuals {arch.attention_residuals}, which no Hugging "
                              "Face model type implements (its pseudo-queries would have nowhere to go): serve it with "
                              "megatron_ext's inference engine instead of exporting it")
    if mtp and not arch.mtp_num_layers:
        raise ConversionError(f"--mtp: {ckpt_dir} has no MTP layers")
    layout = HFLayout("model.", "lm_head.weight", arch.num_layers, kimi_linear=kimi_linear.is_kimi_linear(arch))
    _, model = _meta_model(arch)
    pieces, _ = enumerate_pieces(model, layout)
    if not mtp:
        pieces = [p for p in pieces if not p.key.startswith("mtp.")]
    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype) if dtype else None

    groups, current, size = [], [], 0
    for p in pieces:
        nbytes = torch.Size(p.shape).numel() * torch.tensor([], dtype=out_dtype or p.dtype).element_size()
        if current and size + nbytes > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)

    tmp = atomic.staging_dir(hf_dir)
    weight_map, total = {}, 0
    try:
        for i, group in enumerate(tqdm(groups, desc="shards", unit="shard", disable=None)):
            request = {}
            for j, p in enumerate(group):
                data = torch.empty(p.shape, dtype=p.dtype)
                request[str(j)] = p.sharded_tensor(data)
            loaded = dist_checkpointing.load(request, ckpt_dir, validate_access_integrity=False)
            tensors = {}
            for j, p in enumerate(group):
                t = loaded[str(j)].reshape(p.data_shape)
                if p.key in _VOCAB_KEYS:
                    t = t[: arch.vocab_size]
                tensors[p.hf_name] = (t.to(out_dtype) if out_dtype else t).contiguous()
            if mtp:
                _add_mtp_duplicates(tensors, loaded, group, arch, layout)
            name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
            for k, t in tensors.items():
                weight_map[k] = name
                total += t.numel() * t.element_size()
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_from_preset(arch, out_dtype or pieces[0].dtype, mtp), f, indent=1)
        written = atomic.publish_dir(tmp, hf_dir)
    except BaseException:
        atomic.remove_staging(tmp)
        raise
    kept = sorted(set(existing) - set(written))
    if kept:
        log(f"kept {len(kept)} other entries of {hf_dir} as they were (e.g. {', '.join(kept[:3])})")
    summary = {"tensors": len(weight_map), "shards": len(groups), "peak_rss_mib": peak_rss_mib()}
    log(f"exported {len(weight_map)} tensors in {len(groups)} shard(s) to {hf_dir}; peak RSS "
        f"{summary['peak_rss_mib']:.1f} MiB")
    return summary


def _add_mtp_duplicates(tensors: dict, loaded: dict, group: list[Piece], arch: ModelPreset, layout: HFLayout):
    """DeepSeek-V3's MTP layers carry their own copies of the embedding and the head; write them alongside."""
    for j, p in enumerate(group):
        for k in range(arch.mtp_num_layers):
            prefix = f"{layout.root}layers.{arch.num_layers + k}."
            if p.key == "embedding.word_embeddings.weight":
                tensors[prefix + "embed_tokens.weight"] = tensors[p.hf_name].clone()
            elif p.key == "output_layer.weight":
                tensors[prefix + "shared_head.head.weight"] = tensors[p.hf_name].clone()


def validate_layout(hf_dir: str, tp: int, pp: int, ep: int):
    """Check that the converted model can run at the layout the user means to train with."""
    _, text = read_config(hf_dir)
    arch = preset_from_config(text)
    flags = ["--model", "tiny", "--mock-data", "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep)]
    if tp > 1:
        flags.append("--sequence-parallel")
    parse_args(flags, world_size=math.lcm(tp, ep) * pp, base_arch=arch)

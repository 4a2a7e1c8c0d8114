"""Streaming HF <-> Megatron conversion: one tensor in memory at a time, whatever the model size.

Import writes a Megatron-Core `dist_checkpointing` (torch_dist) checkpoint directly through
`torch.distributed.checkpoint` with a planner whose items are the chunks a one-rank save would write; each chunk
is read (and dequantised) from its safetensors shard only when the writer asks for it. The result is an ordinary
reshardable checkpoint: pretrain_composer.py loads it at any TP/PP/EP (`release/`, loaded as weights only).
Export reads chunks back with `dist_checkpointing.load` one output shard at a time.
"""

from __future__ import annotations

import io
import json
import math
import os
import resource
import shutil

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from safetensors.torch import save_file
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from tqdm import tqdm

from megatron_ext.arguments import parse_args
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


def import_hf(hf_dir: str, save: str, dtype: str | None = None, log=print) -> dict:
    """Convert a HF checkpoint under `hf_dir` into `save/release`. Returns a summary with the peak RSS."""
    full, text = read_config(hf_dir)
    model_type = full["model_type"]
    arch = preset_from_config(text, os.path.join(hf_dir, "config.json"))
    ckpt = ShardedCheckpoint.open(hf_dir)
    layout = HFLayout.detect(ckpt.files, arch.num_layers, model_type)
    skipped = sorted(n for n in ckpt.files if n.startswith(_VISION_PREFIXES))
    if skipped:
        log(f"skipping {len(skipped)} vision-tower / projector tensors (the text backbone is converted)")
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

    def resolve(item: WriteItem):
        if item.type == WriteItemType.BYTE_IO:
            return blobs[item.index.fqn]
        p, piece_dtype = sources[(item.index.fqn, tuple(item.index.offset))]
        filename = ckpt.file_of(p.hf_name)
        if filename not in seen_files:
            seen_files.add(filename)
            shards.update(1)
        value = ckpt.weight(p.hf_name, piece_dtype)
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
        dcp.save({}, storage_writer=writer, planner=_LazyPlanner(items, resolve), no_dist=True)
        common = {"iteration": 0, "format_version": checkpointing.FORMAT_VERSION, "release": True,
                  "args": {**checkpointing._serializable_args(args), "no_save_optim": True},
                  "layout": {}, "optimizer_parts": 0, "opt_param_scheduler": None,
                  "converted_from": os.path.abspath(hf_dir)}
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
              max_shard_bytes: int = 4 << 30, log=print) -> dict:
    """Write the Megatron checkpoint under `load` (its latest, any layout) as HF safetensors shards."""
    tag = checkpointing.read_tracker(load)
    if tag is None:
        raise ConversionError(f"no checkpoint under {load} ({checkpointing.TRACKER} missing)")
    ckpt_dir = checkpointing.checkpoint_dir(load, tag)
    checkpointing.verify_checkpoint(ckpt_dir)
    common = dist_checkpointing.load_common_state_dict(ckpt_dir)
    arch = ModelPreset(**common["args"]["arch"])
    if mtp and not arch.mtp_num_layers:
        raise ConversionError(f"--mtp: {ckpt_dir} has no MTP layers")
    layout = HFLayout("model.", "lm_head.weight", arch.num_layers)
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

    tmp = hf_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
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
        if os.path.exists(hf_dir):
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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

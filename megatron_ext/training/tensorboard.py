"""Read TensorBoard scalars back (float32 as written, so equality is bit-exact for fp32 losses)."""

from __future__ import annotations


def scalars(logdir: str) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar the event files under `logdir` hold."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}

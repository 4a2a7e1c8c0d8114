"""Which prompt file an RL checkpoint's cursor counts into.

The ledger's state (cursor, prompts in flight) is positions and ids in --rl-prompts; applied to another or a
regenerated file it silently skips that file's first cursor-many prompts. The checkpoint therefore records the
file's identity (a hash of the ids in order, and one of the contents), and a resume on a different file stops
unless --rl-new-prompts says to start the new file's cursor from the beginning.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional


def prompt_identity(tasks: list[dict]) -> dict:
    ids, content = hashlib.sha256(), hashlib.sha256()
    for t in tasks:
        ids.update(t["id"].encode() + b"\n")
        content.update(json.dumps(t, sort_keys=True).encode() + b"\n")
    return {"count": len(tasks), "ids_sha256": ids.hexdigest(), "content_sha256": content.hexdigest()}


def prompt_file_change(saved: Optional[dict], current: dict) -> Optional[str]:
    """What differs between the prompt file a checkpoint was trained on and this run's (None: the same, or a
    checkpoint that predates the record)."""
    if not saved:
        return None
    if saved.get("ids_sha256") != current["ids_sha256"]:
        return (f"its ids differ (the checkpoint's file held {saved.get('count')} prompts, this one holds "
                f"{current['count']}, or the same ids in another order)")
    if saved.get("content_sha256") != current["content_sha256"]:
        return "the ids are the same but the prompts' contents differ (a regenerated file)"
    return None

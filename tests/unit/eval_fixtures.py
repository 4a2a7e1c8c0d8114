"""A tiny evaluation suite for the eval tests: the demo calc repository (hidden tests outside it) under several
task ids, each with its own reference diff size, and script-agent folders (oracle, no-op); a headless-chromium
check that a report page's images load."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import tempfile

from megatron_ext.env.demo import ORACLE, make_task

REFERENCE_DIFF_LINES = {"add-a": 2, "add-b": 6, "add-c": 40}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_suite(root: str, ids=("add-a", "add-b")) -> str:
    """root/suite/suite.jsonl holding one task per id (same repo and hidden tests); returns its path."""
    template = json.load(open(make_task(os.path.join(root, "suite"))))
    os.remove(os.path.join(root, "suite", "task.json"))
    path = os.path.join(root, "suite", "suite.jsonl")
    with open(path, "w") as f:
        for i, task_id in enumerate(ids):
            record = {**template, "id": task_id, "instruction": template["instruction"] + " " * i,
                      "metadata": {**template["metadata"], "reference_diff_lines": REFERENCE_DIFF_LINES[task_id]}}
            f.write(json.dumps(record) + "\n")
    return path


def script_dir(root: str, name: str, actions_by_id: dict) -> str:
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    for task_id, actions in actions_by_id.items():
        with open(os.path.join(folder, f"{task_id}.json"), "w") as f:
            json.dump(actions, f)
    return folder


def oracle_dir(root: str, ids=("add-a", "add-b")) -> str:
    return script_dir(root, "oracle", {i: ORACLE for i in ids})


def run_eval_main():
    """tools/run_eval.py's main(), imported (no new interpreter)."""
    spec = importlib.util.spec_from_file_location("run_eval", os.path.join(ROOT, "tools", "run_eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def chromium_image_sizes(html_path: str) -> list[dict]:
    """Load the page in headless chromium and read every image's natural size (a script added to a copy)."""
    probe = ("<script>window.addEventListener('load', () => { const p = document.createElement('pre'); "
             "p.id = 'image-check'; p.textContent = JSON.stringify([...document.images].map(i => "
             "({id: i.id, w: i.naturalWidth, h: i.naturalHeight}))); document.body.appendChild(p); });</script>")
    broken = '<img id="broken-control" src="data:image/png;base64,AAAA">'  # must come back 0 x 0
    with tempfile.TemporaryDirectory() as folder:
        page = os.path.join(folder, "page.html")
        with open(page, "w") as f:
            f.write(open(html_path).read().replace("</body>", broken + probe + "</body>"))
        out = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                              "--no-first-run", "--disable-background-networking", "--disable-component-update",
                              "--disable-sync", f"--user-data-dir={folder}/profile", "--virtual-time-budget=10000",
                              "--dump-dom", f"file://{page}"], capture_output=True, text=True, timeout=180)
    found = re.search(r'<pre id="image-check">(.*?)</pre>', out.stdout, re.S)
    assert found, f"chromium printed no image check: {out.stdout[-1000:]} {out.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"'))

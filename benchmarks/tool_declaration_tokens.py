"""Tokens of the tool declarations, full and compact (--env-tool-declarations), as the chat template renders them.

    python benchmarks/tool_declaration_tokens.py --out runs/tool_tokens [--vocab 1024 2048] [--tokenizer DIR ...]

For each tokenizer: the rendered ``tool_declare`` message of the coding tools and of the swarm's, an episode's
first prompt (declarations, system prompt, instruction), and whole oracle conversations of the demo tasks (the
SFT lines tools/build_agent_sft.py writes, played in the sandbox), each both ways. Tokenizers: byte-level BPE
trained here on standard-library code at each --vocab ("code"), and on that code plus the text of the oracle
conversations ("code+agent": what a tokenizer trained on the SFT data as well sees), and any --tokenizer given.
Writes OUT/tool_tokens.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.data import bpe  # noqa: E402
from megatron_ext.data.corpus import build_corpus, stdlib_dir  # noqa: E402
from megatron_ext.data.sft import render_chat  # noqa: E402
from megatron_ext.data.tokenizers import build_tokenizer  # noqa: E402
from megatron_ext.env.agents import ScriptAgent  # noqa: E402
from megatron_ext.env.demo import ORACLE, TWO_PART_SERIAL, make_task, make_two_part_task  # noqa: E402
from megatron_ext.env.episode import SYSTEM_PROMPT, EpisodeConfig, Session, drive  # noqa: E402
from megatron_ext.env.sandbox import BubblewrapConfig  # noqa: E402
from megatron_ext.env.swarm import SWARM_TOOL_SCHEMAS  # noqa: E402
from megatron_ext.env.tasks import load_task  # noqa: E402
from megatron_ext.env.tools import TOOL_DECLARATIONS, TOOL_SCHEMAS, declarations  # noqa: E402

KINDS = TOOL_DECLARATIONS


def oracle_conversations(work: str) -> dict:
    """{task id: transcript up to the model's last turn} of the demo oracles, played in the sandbox."""
    out = {}
    for maker, actions in ((make_task, ORACLE), (make_two_part_task, TWO_PART_SERIAL)):
        task = load_task(maker(os.path.join(work, maker.__name__)))
        config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=work))
        result = drive(Session(task, config), ScriptAgent(actions), TOOL_SCHEMAS)
        if not result.grading.get("correct"):
            raise RuntimeError(f"the demo oracle of {task.id} was graded wrong: {result.grading.get('output')}")
        out[task.id] = (task.instruction, result.messages[:-1])
    return out


def agent_texts(conversations: dict) -> list[str]:
    texts = []
    for kind in KINDS:
        texts.append(json.dumps(declarations(TOOL_SCHEMAS, kind), separators=(",", ":")))
    for _, messages in conversations.values():
        for m in messages:
            texts.append(m.get("content") or "")
            texts += [c["function"]["arguments"] for c in m.get("tool_calls", [])]
    return [t for t in texts if t]


def measure(tokenizer, conversations: dict) -> dict:
    probe = [{"role": "user", "content": "x"}]
    bare = len(render_chat(tokenizer, probe).ids)
    row = {}
    for kind in KINDS:
        for name, schemas in (("coding", TOOL_SCHEMAS), ("swarm", SWARM_TOOL_SCHEMAS)):
            row[f"declare_{name}_{kind}"] = len(render_chat(tokenizer, probe, tools=declarations(schemas, kind)).ids) \
                - bare
        tools = declarations(TOOL_SCHEMAS, kind)
        for task_id, (instruction, messages) in conversations.items():
            first = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
            row[f"prompt_{task_id}_{kind}"] = len(render_chat(tokenizer, first, tools=tools,
                                                              add_generation_prompt=True).ids)
            row[f"episode_{task_id}_{kind}"] = len(render_chat(tokenizer, messages, tools=tools).ids)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, nargs="*", default=[1024, 2048], help="BPE sizes to train and measure")
    p.add_argument("--tokenizer", action="append", default=[], help="also measure this tokenizer (directory)")
    p.add_argument("--max-files", type=int, default=400, help="standard-library files in the code corpus")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tool-tokens-") as work:
        conversations = oracle_conversations(work)
    corpus = os.path.join(args.out, "corpus.jsonl")
    if not os.path.exists(corpus):
        build_corpus([stdlib_dir()], corpus, extensions=(".py",), max_files=args.max_files)
    with open(corpus) as f:
        code = [json.loads(line)["text"] for line in f if line.strip()]
    tokenizers = {}
    for vocab in args.vocab:
        for name, texts in (("code", code), ("code+agent", code + agent_texts(conversations) * 20)):
            folder = os.path.join(args.out, f"tokenizer-{name.replace('+', '-')}-{vocab}")
            if not os.path.exists(os.path.join(folder, "tokenizer.json")):
                bpe.save(bpe.train_bpe(texts, vocab), folder)
            tokenizers[f"{name} BPE {vocab}"] = folder
    for folder in args.tokenizer:
        tokenizers[folder] = folder
    results = {label: measure(build_tokenizer(None, folder), conversations) for label, folder in tokenizers.items()}
    with open(os.path.join(args.out, "tool_tokens.json"), "w") as f:
        json.dump({"corpus_files": len(code), "results": results}, f, indent=1)
    ids = list(conversations)
    print("| tokenizer | coding tools full | compact | swarm tools full | compact | "
          + " | ".join(f"{i} prompt full | compact | {i} episode full | compact" for i in ids) + " |")
    print("|---" * (5 + 4 * len(ids)) + "|")
    for label, r in results.items():
        cells = [r["declare_coding_full"], r["declare_coding_compact"], r["declare_swarm_full"],
                 r["declare_swarm_compact"]]
        for i in ids:
            cells += [r[f"prompt_{i}_full"], r[f"prompt_{i}_compact"], r[f"episode_{i}_full"],
                      r[f"episode_{i}_compact"]]
        print(f"| {label} | " + " | ".join(map(str, cells)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

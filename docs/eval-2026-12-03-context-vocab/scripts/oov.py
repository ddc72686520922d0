"""How many of plain decoding's answer tokens lie outside the shipped head's draft vocabulary,
and how many of those had already appeared in the context (the prompt, for a second turn also
the first exchange, and the answer so far).

Reads the plain-decoding records of a `ddspec bench` run over MT-bench (both turns), e.g.
    .venv/bin/python docs/eval-2026-12-03-context-vocab/scripts/oov.py \
        docs/bench-2026-12-02-s20-mt80-both-exact/records.jsonl
Prompts are tokenized without the chat template: the template's own tokens are all in the
draft vocabulary, so they do not change the count.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from ddspec.models.loading import load_tokenizer, resolve_model_dir
from ddspec.methods import SHIPPED_HEADS

records = [json.loads(line) for line in open(sys.argv[1])]
records = [r for r in records if r["method"] == "vanilla"]
tok = load_tokenizer(resolve_model_dir("default"))
d2t = load_file(str(SHIPPED_HEADS["SmolLM2-135M-Instruct"] / "model.safetensors"))["d2t"]
vocab = set((torch.arange(d2t.numel()) + d2t).tolist())
questions = {}
for line in open(Path(__file__).resolve().parents[4] / "shared/data/eval/mt_bench.jsonl"):
    q = json.loads(line)
    questions[q["question_id"]] = q["turns"]
first = {r["question_id"]: r["output_ids"] for r in records if r["turn"] == 1}
total = outside = seen_before = 0
missing = collections.Counter()
for r in records:
    turns = questions[r["question_id"]]
    seen = set(tok(turns[0])["input_ids"])
    if r["turn"] == 2:
        seen |= set(first[r["question_id"]]) | set(tok(turns[1])["input_ids"])
    for t in r["output_ids"]:
        total += 1
        if t not in vocab:
            outside += 1
            seen_before += t in seen
            missing[t] += 1
        seen.add(t)
print(f"{total} answer tokens in {len(records)} turns; {outside} ({outside / total:.1%}) outside the "
      f"{len(vocab)}-token draft vocabulary; {seen_before} of those ({seen_before / outside:.0%}) already in the context")
print("most frequent outside:", ", ".join(f"{tok.decode([t])!r} {n}" for t, n in missing.most_common(20)))

"""Losslessness on the default model: a random-init head, 8 prompts x 64 new tokens.

Every prompt runs plain greedy decoding and one speculative method (the four methods take
turns, two prompts each, so CI stays short); `ddspec bench` checks all methods on all prompts.
"""

from __future__ import annotations


import pytest
import torch

from ddspec.bench.prompts import load_prompt_file
from ddspec.config import StopConfig, TreeConfig
from ddspec.datasets import eval_set
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.methods import tree_config
from ddspec.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow
METHODS = ("chain", "eagle", "eagle2", "ddd")
SMALL = TreeConfig(top_k=4, depth=4, total_tokens=8, ddd_check_depths=(2, 4), max_depth=5)
DRAFT_VOCAB = 4096  # the head drafts over the first 4096 ids: cheap lm_head, and it exercises d2t


def prompts(n: int = 8) -> list[str]:
    return [p.turns[0] for p in load_prompt_file(eval_set("mt-bench"), limit=n)]


@pytest.mark.heavy
def test_random_head_greedy_equals_plain_on_default_model(default_native):
    target = default_native
    head = random_head(target.hf_config, seed=0)
    head.register_buffer("d2t", torch.zeros(DRAFT_VOCAB, dtype=torch.long))
    head.eval().requires_grad_(False)
    drafters = {m: EagleDrafter(head, target, tree_config(m, SMALL)) for m in METHODS}
    stop = StopConfig(max_new_tokens=64, stop_on_eos=False)
    for i, text in enumerate(prompts()):
        ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": text}])
        ref = Engine(target).generate(ids, stop).token_ids
        method = METHODS[i % len(METHODS)]
        got = Engine(target, drafters[method]).generate(ids, stop).token_ids
        assert got == ref, f"prompt {i} ({method}) differs from plain decoding"

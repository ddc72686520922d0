"""Integration on the default model (SmolLM2-135M-Instruct): both implementations agree."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import StopConfig
from ddspec.engine import Engine
from ddspec.prompts import chat_prompt_ids

pytestmark = pytest.mark.slow


def test_default_model_greedy_native_equals_hf(default_native, default_hf):
    ids = chat_prompt_ids(default_native.tokenizer, [{"role": "user", "content": "Write a short poem about rivers."}])
    stop = StopConfig(max_new_tokens=64, stop_on_eos=False)
    native = Engine(default_native).generate(ids, stop)
    hf = Engine(default_hf).generate(ids, stop)
    assert native.stats.new_tokens == 64
    assert native.token_ids == hf.token_ids
    assert len(set(native.token_ids)) > 10  # a real answer, not a repeated token


def test_default_model_prefill_logits_close(default_native, default_hf):
    ids = torch.tensor(chat_prompt_ids(default_native.tokenizer, [{"role": "user", "content": "Hello!"}]))
    outs = []
    for t in (default_native, default_hf):
        t.reset(64)
        outs.append(t.forward(ids, torch.arange(len(ids))))
    assert (outs[0].logits - outs[1].logits).abs().max() <= 1e-3
    assert default_native.info.eos_token_ids == (2,)

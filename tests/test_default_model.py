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


def test_shipped_head_is_the_default_and_lossless(default_native, monkeypatch):
    from ddspec.methods import make_drafter, shipped_head

    monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", "q8_0")  # as users run it (the native default)
    assert shipped_head(default_native.info) is not None
    drafter = make_drafter("ddd", default_native, None)  # no --head: the shipped one
    assert hasattr(drafter.head, "d2t") and drafter.head.d2t.numel() == 8192
    stop = StopConfig(max_new_tokens=48)
    accepted = 0
    for text in ("Name three uses of copper.", "What is 17 times 3? Explain briefly."):
        ids = chat_prompt_ids(default_native.tokenizer, [{"role": "user", "content": text}])
        ref = Engine(default_native).generate(ids, stop)
        res = Engine(default_native, drafter).generate(ids, stop)
        assert res.token_ids == ref.token_ids
        accepted += sum(s.accepted for s in res.stats.steps)
    assert accepted > 10  # a trained head: it drafts tokens the target accepts


def test_the_default_tokenizer_loads_directly_and_equals_autotokenizer(default_native):
    """tokenizer.json read directly (no model config, no modelling imports) gives AutoTokenizer's tokenizer."""
    from transformers import AutoTokenizer

    from ddspec.models.loading import load_tokenizer, resolve_model_dir

    folder = resolve_model_dir("default")
    direct, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert type(direct) is type(auto)
    messages = [{"role": "user", "content": "Héllo <|im_end|> 中文 1234\n\tdef f(x): return x**2"}]
    assert direct.apply_chat_template(messages, add_generation_prompt=True) == \
        auto.apply_chat_template(messages, add_generation_prompt=True)
    assert direct.eos_token_id == auto.eos_token_id and direct.all_special_ids == auto.all_special_ids
    assert direct._tokenizer.to_str() == auto._tokenizer.to_str()


def test_a_shipped_head_is_found_by_the_models_published_name(monkeypatch, tmp_path):
    """A head ships for a model, not for one file: any quantisation whose published name (a GGUF's
    general.name) starts with the model's name finds it; another size or model does not."""
    from ddspec import methods
    from ddspec.models.base import ModelInfo

    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    monkeypatch.setattr(methods, "SHIPPED_HEADS", {"Qwen2.5-Coder-0.5B-Instruct": head})

    def info(name, published):
        return ModelInfo("qwen2", 10, 8, 1, 64, (0,), name=name, published=published)

    assert methods.shipped_head(info("/m/q.gguf", "Qwen2.5 Coder 0.5B Instruct AWQ")) == head
    assert methods.shipped_head(info("/m/Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-0.5B-Instruct")) == head
    assert methods.shipped_head(info("/m/q.gguf", "Qwen2.5 Coder 1.5B Instruct GGUF")) is None
    assert methods.shipped_head(info("/m/q.gguf", "")) is None
    # a file named for the model, whatever general.name its converter wrote (the default model's GGUF)
    assert methods.shipped_head(info("/m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "Smollm2 Mix1 Ep2")) == head
    assert methods.shipped_head(info("/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "")) is None

"""Plain decoding through the engine loop: greedy equals a hand-written argmax loop, stop rules,
sampling reproducible with a seed."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig
from ddspec.engine import Engine
from ddspec.errors import ConfigError, DdspecError


def argmax_loop(target, prompt: list[int], n: int) -> list[int]:
    """The obvious reference: re-run the whole sequence every token, no cache reuse."""
    seq = list(prompt)
    for _ in range(n):
        target.reset(len(seq) + 1)
        out = target.forward(torch.tensor(seq), torch.arange(len(seq)))
        seq.append(int(out.logits[-1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("impl", ("native", "hf"))
def test_greedy_equals_reference_loop(tiny_targets, impl):
    target = tiny_targets[("llama", impl)]
    prompt = [5, 17, 33, 8, 90]
    ref = argmax_loop(target, prompt, 20)
    res = Engine(target).generate(prompt, StopConfig(max_new_tokens=20, stop_on_eos=False))
    assert res.token_ids == ref
    assert res.stats.new_tokens == 20 and res.stats.finish_reason == "length"
    assert len(res.stats.steps) == 19  # the first token comes from the prefill
    assert res.stats.tau == 1.0


def test_stops_at_eos(tiny_targets):
    target = tiny_targets[("llama", "native")]
    prompt = [5, 17, 33, 8, 90]
    free = argmax_loop(target, prompt, 12)
    eos = free[6]
    target.info.__class__  # ModelInfo is frozen: build a copy with this eos
    from dataclasses import replace

    original = target.info
    target.info = replace(original, eos_token_ids=(eos,))
    try:
        res = Engine(target).generate(prompt, StopConfig(max_new_tokens=12))
    finally:
        target.info = original
    first = free.index(eos)
    assert res.token_ids == free[: first + 1]
    assert res.stats.finish_reason == "eos"


def test_stop_string_cuts_text(tiny_targets):
    target = tiny_targets[("llama", "native")]
    prompt = [5, 17, 33, 8, 90]
    full = Engine(target).generate(prompt, StopConfig(max_new_tokens=16, stop_on_eos=False))
    text = full.text
    assert len(text) >= 4
    stop = text[2:4]
    res = Engine(target).generate(prompt, StopConfig(max_new_tokens=16, stop_strings=(stop,), stop_on_eos=False))
    assert res.stats.finish_reason == "stop_string"
    assert res.text == text[: text.find(stop)]


def test_sampling_reproducible_with_seed(tiny_targets):
    target = tiny_targets[("llama", "native")]
    prompt = [5, 17, 33, 8, 90]
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    runs = [Engine(target, sampling=SamplingConfig(temperature=1.0, seed=s)).generate(prompt, stop).token_ids
            for s in (11, 11, 12)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    greedy = Engine(target).generate(prompt, stop).token_ids
    assert runs[0] != greedy


def test_sampling_matches_manual_sampler(tiny_targets):
    """The engine's sampling draws exactly what a hand-written sampler draws with the same uniforms:
    the token at position t takes the uniform of (seed, t)."""
    from ddspec.sampling import PositionNoise, target_probs

    target = tiny_targets[("qwen2", "native")]
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, seed=4)
    prompt = [3, 4, 5]
    res = Engine(target, sampling=cfg).generate(prompt, StopConfig(max_new_tokens=10, stop_on_eos=False))
    noise = PositionNoise(4)
    seq = list(prompt)
    for _ in range(10):
        target.reset(len(seq) + 1)
        logits = target.forward(torch.tensor(seq), torch.arange(len(seq))).logits[-1]
        p = target_probs(logits, cfg).double()
        u = noise.uniform(len(seq))
        seq.append(int((torch.cumsum(p, 0) <= u * p.sum()).sum()))  # first index with cdf > u
    assert res.token_ids == seq[3:]


def test_prompt_longer_than_context_is_a_clear_error(tiny_targets):
    target = tiny_targets[("llama", "native")]
    with pytest.raises(DdspecError, match="context window is 512"):
        Engine(target).generate(list(range(5, 125)) * 5, StopConfig(max_new_tokens=4))


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"temperature": -1.0}, "--temperature"), ({"top_p": 0.0}, "--top-p"), ({"top_p": 1.5}, "--top-p"),
     ({"top_k": -3}, "--top-k"), ({"temperature": float("nan")}, "--temperature")],
)
def test_invalid_sampling_values_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SamplingConfig(**kwargs)


def test_target_probs_top_k_and_top_p():
    from ddspec.sampling import target_probs

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64))
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95)


def test_incremental_text_equals_full_decode(default_native):
    """Streaming deltas concatenate to the full decode, multi-byte characters included."""
    from ddspec.engine import TextAssembler

    tok = default_native.tokenizer
    text = "Héllo wörld — 東京 🚀 costs €5.\nNew line,  double  space."
    ids = tok.encode(text, add_special_tokens=False)
    asm = TextAssembler(tok, ())
    out = "".join(asm.add([i]) for i in ids) + asm.flush()
    assert out == tok.decode(ids, skip_special_tokens=True)
    asm = TextAssembler(tok, ("東京",))
    out = "".join(asm.add([i]) for i in ids) + asm.flush()
    assert asm.stopped and out == text[: text.find("東京")]
    # the fast tokenizer's backend decodes (no wrapper): the same text, special tokens skipped too
    assert asm._backend is not None
    special = [tok.convert_tokens_to_ids("<|im_start|>")] + ids[:9] + [tok.eos_token_id] + ids[9:]
    asm = TextAssembler(tok, ())
    assert "".join(asm.add([i]) for i in special) + asm.flush() == tok.decode(special, skip_special_tokens=True)
    wrapped = TextAssembler(tok, ())
    wrapped._backend = None
    assert "".join(wrapped.add([i]) for i in special) + wrapped.flush() == tok.decode(special, skip_special_tokens=True)

"""Replayed τ: a head's trees checked against plain decoding's answer give the engine's τ."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import TreeConfig
from ddspec.methods import resolve_head
from ddspec.train.evaluate import evaluate_head
from ddspec.train.replay import ReplayTarget

PROMPTS = [["Write a Python function that reverses a string.", "Now make it handle None."],
           ["List three prime numbers and explain why they are prime."]]


@pytest.fixture(scope="module")
def default_int8():
    from ddspec.models.loading import load_target

    return load_target("default", impl="native", activations="int8")


@pytest.mark.parametrize("method,activations", [("eagle2", "fp32"), ("ddd", "fp32"), ("eagle2", "int8")])
def test_replayed_tau_equals_the_engines(default_native, default_int8, method, activations):
    """The default model and its shipped head (trees that are accepted often, several levels deep):
    step for step the same accepted lengths as verifying every tree on the target, two-turn
    conversations included."""
    target = default_native if activations == "fp32" else default_int8
    head = resolve_head(None, target)
    tree = TreeConfig(top_k=4, depth=4, total_tokens=16, max_depth=6, ddd_check_depths=(2, 4))
    real = evaluate_head(target, head, PROMPTS, 40, tree, method=method)
    replayed = evaluate_head(target, head, PROMPTS, 40, tree, method=method, replay=True)
    assert real["tau"] > 1.3  # the trees are accepted (a test of a head that never drafts right would prove little)
    for key in ("tau_tokens", "tau_steps", "depth_acceptance", "by_turn", "identical_to_plain"):
        assert replayed[key] == real[key], key
    assert replayed["replay"] and not real["replay"]


def test_a_replayed_forward_accepts_exactly_the_rows_that_spell_the_answer():
    answer = [5, 6, 7, 8, 9]
    features = torch.arange(5.0).unsqueeze(1).repeat(1, 3)  # position p: features p
    target = ReplayTarget(object(), answer, features, {2: features * 10})
    target.truncate(2)  # positions 0-1 are in the cache; the root (7) sits at 2
    # root 7 @2, children 8 (right) and 4 (wrong) @3, then 9 under 8 (right) and 9 under 4 @4
    tokens = torch.tensor([7, 8, 4, 9, 9])
    parents = [-1, 0, 0, 1, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    out = target.forward(tokens, torch.tensor([2, 3, 3, 4, 4]), mask, (2,))
    assert out.argmax.tolist() == [8, 9, -1, -1, -1]  # beyond the answer's end: -1 too
    assert out.features[:, 0].tolist() == [2.0, 3.0, 0.0, 4.0, 0.0]
    assert out.hidden_states[2][:, 0].tolist() == [20.0, 30.0, 0.0, 40.0, 0.0]
    assert target.cache_length == 7
    target.commit(torch.tensor([0, 1, 3]))
    assert target.cache_length == 5
    # without a mask (a prefill chunk): causal, a wrong token ends the matching rows
    target.truncate(0)
    out = target.forward(torch.tensor([5, 6, 0, 8]), torch.arange(4), None, ())
    assert out.argmax.tolist() == [6, 7, -1, -1]

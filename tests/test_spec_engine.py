"""The speculative engine is lossless: every method's greedy output equals plain decoding."""

from __future__ import annotations

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.draft.reference import OracleDrafter, RandomDrafter
from ddspec.engine import Engine
from ddspec.errors import ConfigError
from ddspec.methods import METHODS, tree_config
from ddspec.tree.cost import CostModel, flat_cost

SPEC_METHODS = [m for m in METHODS if m != "vanilla"]
PROMPTS = [[5, 17, 33, 8, 90], [40, 41, 42], [7] * 9, [100, 3, 64, 12, 99, 1, 2, 77]]
SMALL = TreeConfig(top_k=4, depth=4, total_tokens=14, ddd_check_depths=(2, 4), max_depth=5)


def eagle(target, method: str, seed: int = 0, base: TreeConfig = SMALL) -> EagleDrafter:
    head = random_head(target.hf_config, seed=seed).eval().requires_grad_(False)
    cfg = tree_config(method, base)
    if cfg.depth_policy != "cost":
        return EagleDrafter(head, target, cfg)
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, linear_cost

    cost = CostModel(linear_cost(2.0, 0.05), draft_root_ms=0.1, draft_level_ms=0.2, other_ms=0.1)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    return EagleDrafter(head, target, cfg, cost_policy=policy)


def plain(target, prompt, n):
    return Engine(target).generate(prompt, StopConfig(max_new_tokens=n, stop_on_eos=False))


@pytest.mark.parametrize("method", SPEC_METHODS)
@pytest.mark.parametrize("family, impl", [("llama", "native"), ("qwen2", "native"), ("mistral", "hf")])
def test_random_head_output_equals_plain(tiny_targets, family, impl, method):
    target = tiny_targets[(family, impl)]
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    for prompt in PROMPTS[:2]:
        ref = plain(target, prompt, 30).token_ids
        res = Engine(target, eagle(target, method)).generate(prompt, stop)
        assert res.token_ids == ref
        if method != "ddspec":  # the cost-aware policy may rightly verify the root alone
            assert all(s.tree_size > 1 for s in res.stats.steps)


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_oracle_drafter_accepts_everything(tiny_targets, depth):
    target = tiny_targets[("llama", "native")]
    prompt = PROMPTS[0]
    ref = plain(target, prompt, 40).token_ids
    oracle = OracleDrafter(prompt + ref, depth)
    res = Engine(target, oracle).generate(prompt, StopConfig(max_new_tokens=40, stop_on_eos=False))
    assert res.token_ids == ref
    full_steps = [s for s in res.stats.steps[:-1]]
    assert full_steps and all(s.accepted == depth for s in full_steps)  # tau = depth + 1
    assert res.stats.tau > depth  # the last step may be cut short by max_new_tokens


def test_random_drafter_accepts_almost_nothing(tiny_targets):
    target = tiny_targets[("qwen2", "native")]
    prompt = PROMPTS[1]
    ref = plain(target, prompt, 40).token_ids
    res = Engine(target, RandomDrafter(target.info.vocab_size, size=12, seed=3)).generate(
        prompt, StopConfig(max_new_tokens=40, stop_on_eos=False))
    assert res.token_ids == ref
    assert res.stats.tau < 1.5


def test_trained_like_head_accepts_some_tokens(tiny_targets):
    """A head whose predicted feature is the target's own feature at the root's position is not
    possible to build by hand, but a chain from the oracle mixed with noise is: check that
    partial acceptance (0 < accepted < depth) keeps the output exact."""
    target = tiny_targets[("llama", "native")]
    prompt = PROMPTS[2]
    ref = plain(target, prompt, 40).token_ids
    seq = prompt + ref
    noisy = list(seq)
    for i in range(len(prompt) + 2, len(noisy), 3):
        noisy[i] = (noisy[i] + 1) % target.info.vocab_size

    class HalfOracle(OracleDrafter):
        def propose(self, root, position):
            ahead = torch.tensor(noisy[position + 1 : position + 1 + self.depth], dtype=torch.long)
            from ddspec.tree import DraftTree

            return DraftTree.chain(root, ahead, torch.zeros(ahead.numel()))

    res = Engine(target, HalfOracle(seq, 4)).generate(prompt, StopConfig(max_new_tokens=40, stop_on_eos=False))
    assert res.token_ids == ref
    accepted = {s.accepted for s in res.stats.steps}
    assert len(accepted) > 1 and 0 < res.stats.tau - 1 < 4


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_sampling_with_seed_is_reproducible(tiny_targets, method):
    target = tiny_targets[("llama", "native")]
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=5)
    stop = StopConfig(max_new_tokens=25, stop_on_eos=False)
    a = Engine(target, eagle(target, method), cfg).generate(PROMPTS[0], stop).token_ids
    b = Engine(target, eagle(target, method), cfg).generate(PROMPTS[0], stop).token_ids
    assert a == b and len(a) == 25


def test_reduced_draft_vocabulary_stays_lossless(tiny_targets):
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=1)
    vocab = torch.arange(10, 74)  # a 64-token draft vocabulary
    head.register_buffer("d2t", vocab - torch.arange(64))
    head.eval().requires_grad_(False)
    drafter = EagleDrafter(head, target, tree_config("eagle2@c0", SMALL))  # the head's vocabulary alone
    ref = plain(target, PROMPTS[0], 30).token_ids
    res = Engine(target, drafter).generate(PROMPTS[0], StopConfig(max_new_tokens=30, stop_on_eos=False))
    assert res.token_ids == ref
    tree = drafter.propose(torch.tensor(ref[-1]), drafter.cache.length)
    assert bool(((tree.tokens[1:] >= 10) & (tree.tokens[1:] < 74)).all())


def test_ddd_stops_at_a_check_depth_and_counts_syncs(tiny_targets):
    target = tiny_targets[("llama", "native")]
    base = TreeConfig(top_k=3, total_tokens=10, ddd_check_depths=(2, 3), max_depth=4, ddd_threshold=-1e-6)
    drafter = eagle(target, "ddd", base=base)
    Engine(target, drafter).generate(PROMPTS[0], StopConfig(max_new_tokens=3, stop_on_eos=False))
    policy = drafter.last_policy
    assert policy.syncs == 1  # a random head's beam mass is far below ~1.0: stops at the first check


def test_impossible_tree_settings_are_clear(tiny_targets):
    target = tiny_targets[("llama", "native")]
    with pytest.raises(ConfigError, match="vocabulary"):
        eagle(target, "eagle2", base=TreeConfig(top_k=500))
    for bad in ({"total_tokens": 0}, {"depth": 0}, {"ddd_threshold": float("nan")}, {"ddd_threshold": "x"}):
        with pytest.raises(ConfigError):
            TreeConfig(**bad)


@pytest.mark.parametrize("method", ["eagle", "eagle2", "chain"])
def test_tree_scores_match_sequential_head_reference(tiny_targets, method):
    """Every node's score from tree drafting (head KV cache + tree masks + positions) equals the
    score from running the head sequentially, without a cache, along the node's path."""
    target = tiny_targets[("llama", "native")]
    drafter = eagle(target, method, seed=2)
    head = drafter.head
    prompt = torch.tensor(PROMPTS[3])
    target.reset(64)
    out = target.forward(prompt, torch.arange(len(prompt)))
    root = out.logits[-1].argmax()
    drafter.reset(64)
    drafter.prefill(prompt, out, root)
    tree = drafter.propose(root, len(prompt))
    assert tree.size > 3

    tokens = torch.cat([prompt[1:], root.view(1)])  # token_{t+1} of each committed entry
    for node in range(1, tree.size):
        path = tree.path_to(node).tolist()
        feats, toks, score = out.features, tokens, 0.0
        hidden = None
        for i, n in enumerate(path[1:], start=1):
            with torch.no_grad():
                t = feats.shape[0]
                hidden = head(target.embed(toks).view(1, t, -1), feats.view(1, t, -1), torch.arange(t))[0]
            score += float(drafter.logprobs(hidden[-1:])[0, tree.tokens[n]])
            feats = torch.cat([feats, hidden[-1:]])
            toks = torch.cat([toks, tree.tokens[n].view(1)])
        assert abs(score - float(tree.scores[node])) < 1e-4, f"node {node} path {path}"


def test_ddspec_method_calibrates_once_and_stays_lossless(tiny_targets, tmp_path, monkeypatch):
    from ddspec.methods import make_drafter

    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4).eval().requires_grad_(False)
    drafter = make_drafter("ddspec", target, head, SMALL)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    make_drafter("ddspec", target, head, SMALL)  # cached: not measured again
    assert files[0].stat().st_mtime_ns == stamp
    ref = plain(target, PROMPTS[0], 30).token_ids
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    # with the measured costs the policy may rightly decide that a random head is not worth
    # drafting on a slow, busy machine (CI once measured that), so lossless is all it must be
    assert Engine(target, drafter).generate(PROMPTS[0], stop).token_ids == ref
    # with a flat verification cost every drafted node pays, so it drafts and learns
    drafter = make_drafter("ddspec", target, head, SMALL)
    drafter.cost_policy.cost = CostModel(flat_cost(20.0), draft_root_ms=0.1, draft_level_ms=0.1)
    assert Engine(target, drafter).generate(PROMPTS[0], stop).token_ids == ref
    assert sum(drafter.cost_policy.acceptance.seen) > 0  # it learned from the verdicts


def test_auto_method_is_ddspec_with_a_head_and_lookup_without(tiny_targets, default_native):
    from ddspec.methods import default_method

    tiny = tiny_targets[("llama", "native")]
    assert default_method(tiny, None) == "lookup"  # no head ships for a tiny random model
    assert default_method(tiny, "random") == "ddspec"
    assert default_method(default_native, None) == "ddspec"  # the shipped SmolLM2 head


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_drafts_stay_inside_the_context_window(tiny_targets, method):
    """A prompt near the end of the window: trees must not reach past it (RoPE tables end there)."""
    target = tiny_targets[("llama", "native")]
    window = target.info.max_position
    prompt = [(7 * i) % 100 + 5 for i in range(window - 12)]
    stop = StopConfig(max_new_tokens=32, stop_on_eos=False)
    ref = plain(target, prompt, 32).token_ids
    res = Engine(target, eagle(target, method)).generate(prompt, stop)
    assert res.token_ids == ref and len(ref) == 12  # the budget ends at the window


def _head_with_temperature(target, t):
    head = random_head(target.hf_config, seed=3).eval().requires_grad_(False)
    if t is not None:
        head.config["ddspec"] = {"draft_temperature": {"greedy": t}}
    return head


def test_greedy_draft_temperature_scores_the_tree_and_keeps_outputs(tiny_targets):
    """A head's fitted temperature divides its logits in greedy decoding only; --draft-temperature
    overrides it; the output stays plain decoding's either way."""
    target = tiny_targets[("llama", "native")]
    head = _head_with_temperature(target, 0.5)
    hidden = torch.randn(3, target.info.hidden_size, generator=torch.Generator().manual_seed(0))
    raw = EagleDrafter(_head_with_temperature(target, None), target, SMALL)
    assert raw.temperature == 1.0
    logits = raw.lm_head(hidden).float()
    d = EagleDrafter(head, target, SMALL)
    assert d.temperature == 0.5
    torch.testing.assert_close(d.logprobs(hidden), torch.log_softmax(logits / 0.5, -1))
    d.score_for(SamplingConfig(temperature=0.8, seed=1))  # sampling: the raw head's scores
    assert d.temperature == 1.0
    torch.testing.assert_close(d.logprobs(hidden), torch.log_softmax(logits, -1))
    d.score_for(SamplingConfig())
    assert d.temperature == 0.5
    from dataclasses import replace

    forced = EagleDrafter(head, target, replace(SMALL, draft_temperature=2.0))
    forced.score_for(SamplingConfig())
    assert forced.temperature == 2.0
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    for method in ("eagle2", "ddd", "ddspec"):
        for prompt in PROMPTS[:2]:
            ref = plain(target, prompt, 30).token_ids
            cfg = tree_config(method, SMALL)
            drafter = eagle(target, method) if method == "ddspec" else EagleDrafter(head, target, cfg)
            if method == "ddspec":
                drafter.head_temperature = 0.5
            res = Engine(target, drafter).generate(prompt, stop)
            assert res.token_ids == ref and drafter.temperature == 0.5
    # a sharper score grows a different tree from the same head (the temperature is not a no-op)
    a = EagleDrafter(head, target, tree_config("eagle2", SMALL))
    b = EagleDrafter(head, target, replace(tree_config("eagle2", SMALL), draft_temperature=1.0))
    trees = []
    for drafter in (a, b):
        engine = Engine(target, drafter)
        res = engine.generate(PROMPTS[3], StopConfig(max_new_tokens=12, stop_on_eos=False))
        trees.append([s.tree_size for s in res.stats.steps] + [float(drafter.logprobs(hidden).max())])
    assert trees[0] != trees[1]


def test_bad_draft_temperatures_are_refused(tiny_targets):
    target = tiny_targets[("llama", "native")]
    for bad in (0, -1.0, float("nan"), 11.0, True):
        with pytest.raises(ConfigError, match="draft_temperature"):
            TreeConfig(draft_temperature=bad)
    for bad in (0, "0.8", -2):
        with pytest.raises(ConfigError, match="ddspec.draft_temperature.greedy"):
            EagleDrafter(_head_with_temperature(target, bad), target, SMALL)

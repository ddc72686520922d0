"""Sampling for any valid temperature and top_p, and seeds that hold whatever the step timings.

1. ``target_probs`` and ``sample`` against a float64 reference written as a plain loop, for
   temperatures from 1e-38 to 1e4 (and the smallest doubles the config accepts) and top_p from
   1e-45 to 1, over random and adversarial logits: never NaN, never a token outside the allowed
   set, probabilities within tolerance of the reference.
2. Seeded sampling gives the same tokens run after run for every method while the step timings
   (the engine's clock) and the cost-aware method's costs are perturbed on purpose, and these
   tokens are plain seeded decoding's.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.methods import METHODS, make_drafter, tree_config
from ddspec.sampling import PositionNoise, next_token, sample, target_probs

V = 48
F32_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)  # 1.4e-45
TEMPERATURES = sorted({*np.logspace(-38, 4, 22).tolist(), 1e-37, 1e-300, 5e-324, 1e-45, 1e-40, 0.8, 1.0})
TOP_PS = sorted({*np.logspace(-45, 0, 10).tolist(), 1e-46, 1e-300, 5e-324, 0.5, 0.9, 0.999999, 1.0})


def _logit_rows() -> dict[str, torch.Tensor]:
    """Rows [V] float32: random and adversarial (huge, tiny, ties, -inf masks, +inf, NaN)."""
    g = torch.Generator().manual_seed(0)
    rows = {
        "normal": torch.randn(V, generator=g),
        "wide": 30 * torch.randn(V, generator=g),
        "huge": (torch.rand(V, generator=g) * 2 - 1) * F32_MAX,
        "huge_positive": F32_MAX - torch.arange(V, dtype=torch.float32) * 1e32,
        "tiny": torch.randint(-5, 6, (V,), generator=g).float() * TINY,  # subnormal gaps
        "ties": torch.tensor([3.0, 1.0, 3.0, 2.0] * (V // 4)),
        "all_equal": torch.full((V,), -7.5),
        "near_ties": 1.0 + torch.arange(V, dtype=torch.float32) * 1.2e-7,
    }
    masked = torch.randn(V, generator=g)
    masked[torch.rand(V, generator=g) < 0.7] = float("-inf")
    rows["masked"] = masked
    one = torch.full((V,), float("-inf"))
    one[V // 3] = -1e30
    rows["one_allowed"] = one
    pos_inf = torch.randn(V, generator=g)
    pos_inf[[4, 9]] = float("inf")
    rows["pos_inf"] = pos_inf
    nan = torch.randn(V, generator=g)
    nan[[1, 2, 3]] = float("nan")
    rows["nan"] = nan
    return rows


ROWS = _logit_rows()


def _reference(row: torch.Tensor, cfg: SamplingConfig) -> np.ndarray:
    """The distribution by its definition, one token at a time in float64 (math, no tensors)."""
    z = [float("-inf") if math.isnan(x) else float(x) for x in row.tolist()]
    if cfg.top_k and cfg.top_k < len(z):
        kth = sorted(z, reverse=True)[cfg.top_k - 1]
        z = [x if x >= kth else float("-inf") for x in z]
    m = max(z)
    if m == float("-inf"):  # nothing allowed: uniform
        w = [1.0] * len(z)
    else:
        w = []
        for x in z:
            if x == m:
                w.append(1.0)
            elif x == float("-inf") or m == float("inf"):
                w.append(0.0)
            else:
                e = (x - m) / cfg.temperature  # may be -inf: exp gives 0
                w.append(math.exp(e) if e > -800 else 0.0)
    total = math.fsum(w)
    p = [x / total for x in w]
    if cfg.top_p < 1.0:
        order = sorted(range(len(p)), key=lambda i: (-p[i], i))
        kept, mass = [], 0.0
        for i in order:
            if kept and mass >= cfg.top_p:
                break
            kept.append(i)
            mass += p[i]
        p = [p[i] if i in set(kept) else 0.0 for i in range(len(p))]
        total = math.fsum(p)
        p = [x / total for x in p]
    return np.array(p)


def _allowed(row: torch.Tensor) -> set[int]:
    """Tokens a sample may ever be: finite or +inf logits (NaN and -inf excluded)."""
    return {i for i, x in enumerate(row.tolist()) if not math.isnan(x) and x != float("-inf")} or set(range(V))


@pytest.mark.parametrize("name", sorted(ROWS))
def test_target_probs_match_a_float64_reference_for_any_temperature_and_top_p(name):
    row = ROWS[name]
    allowed = _allowed(row)
    us = [0.0, 0.25, 0.5, 0.999, 1.0 - 2.0**-53]
    for t in TEMPERATURES:
        for top_p in TOP_PS:
            for top_k in (0, 3):
                cfg = SamplingConfig(temperature=t, top_p=top_p, top_k=top_k)
                p = target_probs(row, cfg)
                assert p.dtype == torch.float64 and not p.isnan().any(), (name, cfg)
                assert abs(float(p.sum()) - 1.0) < 1e-9, (name, cfg)
                support = set(p.nonzero().flatten().tolist())
                assert support and support <= allowed, (name, cfg, support - allowed)
                ref = _reference(row, cfg)
                assert np.abs(p.numpy() - ref).max() < 1e-9, (name, cfg, p, ref)
                drawn = sample(p.expand(len(us), V), torch.tensor(us, dtype=torch.float64)).tolist()
                assert all(p[d] > 0 for d in drawn), (name, cfg, drawn)
                assert int(next_token(row, cfg, us[-1])) == drawn[-1]


def test_a_tiny_temperature_samples_uniformly_among_the_tied_maxima():
    """The limit of softmax(z / T) as T -> 0: the maxima share the mass; the rest get none."""
    row = torch.tensor([1.0, 3.0, 2.9999998, 3.0, -5.0, 3.0])
    for t in (1e-37, 1e-300, 5e-324):
        p = target_probs(row, SamplingConfig(temperature=t))
        assert p.tolist() == [0.0, 1 / 3, 0.0, 1 / 3, 0.0, 1 / 3]
        drawn = {int(sample(p, u)) for u in np.linspace(0, 1, 50, endpoint=False)}
        assert drawn == {1, 3, 5}
    # a top_p that float32 rounds to 0 keeps the most likely token (the first of tied maxima)
    for top_p in (1e-46, 5e-324):
        p = target_probs(row, SamplingConfig(temperature=0.7, top_p=top_p))
        assert p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_a_huge_temperature_is_uniform_over_the_allowed_tokens():
    row = ROWS["masked"]
    allowed = sorted(_allowed(row))
    for t in (1e4, 1e300):
        p = target_probs(row, SamplingConfig(temperature=t))
        assert torch.allclose(p[allowed], torch.full((len(allowed),), 1 / len(allowed), dtype=torch.float64), atol=1e-4)


def test_the_config_accepts_the_extreme_values_tested_here():
    for t in (5e-324, 1e-300, 1e-37, 1e4):
        SamplingConfig(temperature=t)
    for top_p in (5e-324, 1e-46, 1e-45):
        SamplingConfig(temperature=1.0, top_p=top_p)


def test_position_noise_is_a_function_of_seed_and_position():
    a, b = PositionNoise(1), PositionNoise(1)
    us = [a.uniform(t) for t in range(2000)]
    assert us == [b.uniform(t) for t in range(2000)] and all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.03 and len(set(us)) == len(us)
    assert us[:50] != [PositionNoise(2).uniform(t) for t in range(50)]
    for seed in (-1, 0, 2**64, 2**64 + 1, -(2**200)):  # any integer: no two collide
        assert PositionNoise(seed).uniform(7) != PositionNoise(seed + 1).uniform(7)
    assert a.after(10)(0) == a.uniform(11) and a.after(10)(3) == a.uniform(14)
    assert PositionNoise(None).seed != PositionNoise(None).seed


# --- seeds hold whatever the timings ------------------------------------------------------

SMALL = TreeConfig(top_k=4, depth=4, total_tokens=14, ddd_check_depths=(2, 4), max_depth=5)
PROMPT = [5, 17, 33, 8, 90, 5, 17, 33]  # a repeat, so that lookup finds matches


def _jittery_clock(seed: int):
    """time.perf_counter with up to 30 ms of random noise on every reading: every measured draft,
    verify and gap time the cost-aware policy learns from comes out different run after run."""
    import time

    rng = random.Random(seed)
    return lambda: time.perf_counter() + rng.uniform(0.0, 0.03)


COSTS = [(20.0, 0.0), (1.0, 0.0), (10.0, 3.0)]  # (ms of a one-token forward, ms per more token): flat to steep


def _drafter(target, method: str, run: int, rng: random.Random):
    """The method's drafter; the cost-aware one with other calibrated costs each run (as cold runs
    measure them on a busy machine), so that its trees differ from run to run."""
    if method == "vanilla":
        return None
    if method == "lookup":
        return make_drafter("lookup", target, None, SMALL)
    head = random_head(target.hf_config, seed=2).eval().requires_grad_(False)
    cfg = tree_config(method, SMALL)
    if cfg.depth_policy != "cost":
        return EagleDrafter(head, target, cfg)
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, linear_cost

    cost = CostModel(linear_cost(*COSTS[run % len(COSTS)]), draft_root_ms=rng.uniform(0.001, 0.01),
                     draft_level_ms=rng.uniform(0.001, 0.01), other_ms=rng.uniform(0.0, 1.0))
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    return EagleDrafter(head, target, cfg, cost_policy=policy)


@pytest.mark.parametrize("family, impl", [("llama", "native"), ("mistral", "hf")])
def test_seeded_sampling_is_the_same_for_every_method_whatever_the_timings(tiny_targets, family, impl):
    target = tiny_targets[(family, impl)]
    cfg = SamplingConfig(temperature=0.8, top_p=0.95, seed=1)
    stop = StopConfig(max_new_tokens=30, stop_on_eos=False)
    plain = Engine(target, sampling=cfg).generate(PROMPT, stop).token_ids
    assert len(plain) == 30
    shapes = set()
    for method in METHODS:
        for run in range(3 if method == "ddspec" else 2):
            rng = random.Random(100 * run + len(method))
            drafter = _drafter(target, method, run, rng)
            res = Engine(target, drafter, cfg, clock=_jittery_clock(run)).generate(PROMPT, stop)
            assert res.token_ids == plain, (method, run)
            if method == "ddspec":
                shapes.add(tuple(s.tree_size for s in res.stats.steps))
    assert len(shapes) > 1  # the perturbed runs did verify different trees
    other = Engine(target, sampling=SamplingConfig(temperature=0.8, top_p=0.95, seed=2)).generate(PROMPT, stop)
    assert other.token_ids != plain


@pytest.mark.parametrize("method", ["vanilla", "eagle2", "ddspec"])
def test_extreme_values_decode_like_greedy(tiny_targets, method):
    """A temperature so small that the distribution is a point mass, or a top_p that keeps only the
    most likely token, decodes as greedy does (the tiny model's logits have no tied maxima here)."""
    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=20, stop_on_eos=False)
    greedy = Engine(target).generate(PROMPT, stop).token_ids
    for cfg in (SamplingConfig(temperature=1e-37, seed=1), SamplingConfig(temperature=1e-300),
                SamplingConfig(temperature=5e-324, top_k=5), SamplingConfig(temperature=0.8, top_p=1e-46, seed=3)):
        drafter = _drafter(target, method, 0, random.Random(0))
        assert Engine(target, drafter, cfg).generate(PROMPT, stop).token_ids == greedy, cfg

"""Greedy and lossless sampling verification: fast == reference, hand cases, and statistics."""

from __future__ import annotations

import math

import pytest
import torch

from ddspec.config import SamplingConfig
from ddspec.sampling import sample, target_probs
from ddspec.tree import DraftTree
from ddspec.verify.greedy import _vectorised
from ddspec.verify.sampling import _vectorised as _sampled_vectorised
from ddspec.verify import (
    Verdict,
    verify,
    verify_greedy,
    verify_greedy_reference,
    verify_sampling,
    verify_sampling_reference,
)

torch.set_num_threads(1)
V = 8


def _random_tree(gen: torch.Generator, n: int, vocab: int = V) -> DraftTree:
    """n nodes, random parents, distinct sibling tokens."""
    tokens, parents, depths = [int(torch.randint(vocab, (1,), generator=gen))], [-1], [0]
    used: list[set[int]] = [set()]
    for _ in range(1, n):
        open_nodes = [i for i, u in enumerate(used) if len(u) < vocab]
        parent = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=gen))]
        free = [t for t in range(vocab) if t not in used[parent]]
        token = free[int(torch.randint(len(free), (1,), generator=gen))]
        used[parent].add(token)
        used.append(set())
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(n))


def _agreeing_logits(gen: torch.Generator, tree: DraftTree, boost: float = 4.0) -> torch.Tensor:
    """[N, V] random logits that often favour one of each node's children (deep acceptances)."""
    logits = torch.randn(tree.size, V, generator=gen)
    for node, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        if parent >= 0 and torch.rand((), generator=gen) < 0.7:
            logits[parent, token] += boost
    return logits


def _same(a: Verdict, b: Verdict) -> bool:
    return torch.equal(a.path, b.path) and torch.equal(a.bonus, b.bonus)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_matches_reference_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    depths = []
    for _ in range(300):
        tree = _random_tree(gen, int(torch.randint(1, 20, (1,), generator=gen)))
        logits = _agreeing_logits(gen, tree)
        fast, ref = verify_greedy(tree, logits), verify_greedy_reference(tree, logits)
        assert _same(fast, ref), (tree, fast, ref)
        assert _same(_vectorised(tree, logits.argmax(dim=-1)), ref)  # the device path (GPUs), run here on the CPU
        depths.append(fast.accepted)
    assert max(depths) >= 3 and depths.count(0) > 10  # both deep and empty acceptances occurred


def _chain_logits(next_tokens: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(next_tokens), V)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 1.0
    return logits


def test_greedy_accepts_a_full_path_when_the_target_agrees():
    tree = DraftTree.chain(0, torch.tensor([3, 5, 2]), torch.zeros(3))
    verdict = verify_greedy(tree, _chain_logits([3, 5, 2, 7]))
    assert verdict.accepted == 3 and verdict.path.tolist() == [0, 1, 2, 3]
    assert verdict.bonus.item() == 7 and verdict.emitted(tree).tolist() == [3, 5, 2, 7]


def test_greedy_accepts_nothing_and_returns_the_root_argmax():
    tree = DraftTree.chain(0, torch.tensor([3, 5, 2]), torch.zeros(3))
    verdict = verify_greedy(tree, _chain_logits([4, 5, 2, 7]))
    assert verdict.accepted == 0 and verdict.path.tolist() == [0] and verdict.bonus.item() == 4


def test_greedy_follows_the_agreeing_branch():
    # root -> 1 (a) -> 3 (c) ; root -> 2 (b) -> 4 (d); the target agrees with b, d
    tokens, parents, depths = [0, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(5))
    verdict = verify_greedy(tree, _chain_logits([2, 3, 4, 0, 6]))
    assert verdict.path.tolist() == [0, 2, 4] and verdict.bonus.item() == 6


# --- sampling: fast == reference ----------------------------------------------------------

CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_p=0.8),
    SamplingConfig(temperature=1.3, top_k=3),
]


def _uniforms(gen: torch.Generator, tree: DraftTree) -> list[float]:
    """One uniform per depth of `tree` (the engine's are a hash of seed and position)."""
    return torch.rand(int(tree.depths.max()) + 1, generator=gen, dtype=torch.float64).tolist()


@pytest.mark.parametrize("cfg", CONFIGS, ids=["t1", "t0.7-p0.8", "t1.3-k3"])
def test_sampling_fast_matches_reference_under_the_same_uniforms(cfg):
    gen = torch.Generator().manual_seed(1)
    accepted = []
    for _ in range(200):
        tree = _random_tree(gen, int(torch.randint(1, 16, (1,), generator=gen)))
        logits = _agreeing_logits(gen, tree, boost=2.0)
        u = _uniforms(gen, tree).__getitem__
        fast = verify_sampling(tree, logits, cfg, u)
        ref = verify_sampling_reference(tree, logits, cfg, u)
        assert _same(fast, ref), (fast, ref)
        assert _same(_sampled_vectorised(tree, logits, cfg, u), ref)  # the device path, run here on the CPU
        accepted.append(fast.accepted)
    assert max(accepted) >= 2 and accepted.count(0) > 10


def test_sampling_emits_what_plain_sampling_draws_with_the_same_uniforms():
    """Whatever the tree, the emitted tokens are plain decoding's draws at the same positions."""
    gen = torch.Generator().manual_seed(3)
    cfg = SamplingConfig(temperature=0.9, top_p=0.9)
    for _ in range(100):
        tree = _random_tree(gen, int(torch.randint(1, 16, (1,), generator=gen)))
        logits = _agreeing_logits(gen, tree, boost=3.0)
        us = _uniforms(gen, tree)
        verdict = verify_sampling(tree, logits, cfg, us.__getitem__)
        path = verdict.path.tolist()
        emitted = verdict.emitted(tree).tolist()
        for depth, node in enumerate(path):
            assert emitted[depth] == int(sample(target_probs(logits[node], cfg), us[depth]))


def test_verify_dispatches_on_temperature():
    gen = torch.Generator().manual_seed(2)
    tree = _random_tree(gen, 10)
    logits = _agreeing_logits(gen, tree)
    assert _same(verify(tree, logits, SamplingConfig()), verify_greedy(tree, logits))
    cfg = SamplingConfig(temperature=1.0)
    u = _uniforms(gen, tree).__getitem__
    assert _same(verify(tree, logits, cfg, u), verify_sampling(tree, logits, cfg, u))


# --- sampling: statistical losslessness ---------------------------------------------------
#
# A synthetic Markov target over 6 tokens: after token t at position i the next token has
# logits TARGET[i, t]. The draft proposes a deterministic 2-level tree (3 children at the root,
# 2 under each) chosen by a DIFFERENT table DRAFT. Running steps until two tokens are emitted,
# the joint of the first two emitted tokens must be p(t1 | root) * p(t2 | t1).
#
# Bound (Bretagnolle-Huber-Carol): for K categories and n samples,
#   P(sum |p_hat - p| >= lam) <= 2^K exp(-n lam^2 / 2), so with TV = sum / 2,
#   P(TV >= t) <= 2^K exp(-2 n t^2) = FAILURE  at  t = sqrt((K ln 2 + ln(1/FAILURE)) / (2n)).

SMALL_V, ROOT, FAILURE = 6, 0, 1e-6
_tables = torch.Generator().manual_seed(1234)
TARGET = 1.5 * torch.randn(4, SMALL_V, SMALL_V, generator=_tables)  # [position, token, V] logits
DRAFT = 1.5 * torch.randn(4, SMALL_V, SMALL_V, generator=_tables)  # the draft q, a different table


def _tv_bound(n: int, categories: int) -> float:
    return math.sqrt((categories * math.log(2) + math.log(1 / FAILURE)) / (2 * n))


def _step_inputs(position: int, root: int) -> tuple[DraftTree, torch.Tensor]:
    """The draft's tree from `root` at `position`, and the target's logits [N, V] at its nodes."""
    tokens, parents, depths, frontier = [root], [-1], [0], [0]
    for depth, width in ((1, 3), (2, 2)):
        new = []
        for node in frontier:
            for token in DRAFT[position + depth - 1, tokens[node]].topk(width).indices.tolist():
                new.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                depths.append(depth)
        frontier = new
    n = len(tokens)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(n))
    return tree, TARGET[position + tree.depths, tree.tokens]


def _emission_tv(verifier, cfg: SamplingConfig, n: int, seed: int) -> tuple[float, float]:
    """TV distance of the first emitted token, and of the first two, from the target's.

    As in the engine, each position has its own uniform: a step whose root sits at position
    ``start`` draws the token after a node at depth d with the uniform of position start + d + 1."""
    steps = {(0, ROOT): _step_inputs(0, ROOT)} | {(1, t): _step_inputs(1, t) for t in range(SMALL_V)}
    node_tokens = {key: tree.tokens.tolist() for key, (tree, _) in steps.items()}
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(SMALL_V, SMALL_V)
    for _ in range(n):
        us = torch.rand(8, generator=gen, dtype=torch.float64).tolist()  # us[t]: position t's uniform
        emitted: list[int] = []
        key = (0, ROOT)
        while len(emitted) < 2:  # a second step only when the first accepted nothing
            start = len(emitted)
            verdict = verifier(*steps[key], cfg, lambda depth: us[start + depth + 1])
            emitted += [node_tokens[key][i] for i in verdict.path.tolist()[1:]] + [int(verdict.bonus)]
            key = (1, emitted[0])
        counts[emitted[0], emitted[1]] += 1
    p = target_probs(TARGET, cfg)  # [4, V, V]
    joint = p[0, ROOT].unsqueeze(1) * p[1]  # [V, V]: P(t1) * P(t2 | t1)
    empirical = counts / n
    tv_first = 0.5 * (empirical.sum(1) - joint.sum(1)).abs().sum().item()
    return tv_first, 0.5 * (empirical - joint).abs().sum().item()


def _lossy_verify(tree: DraftTree, logits: torch.Tensor, cfg: SamplingConfig, uniform) -> Verdict:
    """Negative control: accept a child when the node's uniform falls below its probability (the
    per-token test without the residual), the bonus from the untouched p with the same uniform."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    path = [0]
    while True:
        p = target_probs(logits[path[-1]], cfg)  # [V]
        u = uniform(depths[path[-1]])
        for child in (c for c in range(1, tree.size) if parents[c] == path[-1]):
            if u < float(p[tokens[child]]):
                path.append(child)
                break
        else:
            return Verdict(torch.tensor(path), sample(p, u))


def test_sampling_is_lossless_and_the_check_detects_a_lossy_variant():
    cfg = SamplingConfig(temperature=1.0)
    n = 20_000  # bounds: 0.021 (first token), 0.031 (first two)
    tv_first, tv_joint = _emission_tv(verify_sampling, cfg, n, seed=7)
    assert tv_first < _tv_bound(n, SMALL_V), tv_first
    assert tv_joint < _tv_bound(n, SMALL_V**2), tv_joint
    n = 4_000  # bounds: 0.047, 0.070; the lossy variant is off by about 0.19 (first token)
    lossy_first, lossy_joint = _emission_tv(_lossy_verify, cfg, n, seed=7)
    assert lossy_first > _tv_bound(n, SMALL_V), lossy_first
    assert lossy_joint > _tv_bound(n, SMALL_V**2), lossy_joint


TRANSFORMS = CONFIGS[1:] + [SamplingConfig(temperature=0.5)]


@pytest.mark.parametrize("cfg", TRANSFORMS, ids=["t0.7-p0.8", "t1.3-k3", "t0.5"])
def test_sampling_is_lossless_with_sampling_transforms(cfg):
    n = 3_000  # bounds: 0.055 (first token), 0.080 (first two)
    tv_first, tv_joint = _emission_tv(verify_sampling, cfg, n, seed=11)
    assert tv_first < _tv_bound(n, SMALL_V) and tv_joint < _tv_bound(n, SMALL_V**2), (tv_first, tv_joint)

"""DraftTree, the EAGLE-2 / static builders and the depth policies, on hand-built inputs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from ddspec.config import TreeConfig
from ddspec.errors import ConfigError
from ddspec.tree import (
    DEFAULT_STATIC_PATHS,
    Candidates,
    DraftTree,
    DynamicDepth,
    FixedDepth,
    StaticShape,
    expand_level,
    expand_root,
    fill_level,
    make_depth_policy,
    most_probable_paths,
    rerank,
)

torch.set_num_threads(1)
V = 8


def _tree(tokens, parents, depths) -> DraftTree:
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(n))


def _row(top: dict[int, float]) -> torch.Tensor:
    """[V] log-probs: the given token probabilities, the rest spread evenly over the others."""
    rest = (1.0 - sum(top.values())) / (V - len(top))
    return torch.tensor([top.get(t, rest) for t in range(V)]).log()


# root 0 -> 1 -> 3 -> 4 ; root -> 2 ; 1 -> 5
HAND = _tree([9, 4, 6, 1, 2, 7], [-1, 0, 0, 1, 3, 1], [0, 1, 1, 2, 3, 2])


def test_attention_mask_rows_are_ancestors_and_self():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(HAND.attention_mask(), expected)


def test_attention_mask_matches_parent_row_loop_on_deep_chains_and_random_trees():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 17, 40):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        chain = list(range(-1, n - 1))
        for par in (parents, chain):
            depths = [0]
            for p in par[1:]:
                depths.append(depths[p] + 1)
            tree = _tree(list(range(n)), par, depths)
            expected = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                if i:
                    expected[i] = expected[par[i]]
                expected[i, i] = True
            assert torch.equal(tree.attention_mask(), expected)


def test_invariants_are_asserted():
    with pytest.raises(AssertionError, match="topological"):
        _tree([0, 1, 2], [-1, 2, 0], [0, 2, 1])
    with pytest.raises(AssertionError, match="root"):
        _tree([0, 1], [0, 0], [0, 1])
    with pytest.raises(AssertionError, match="depths"):
        _tree([0, 1, 2], [-1, 0, 1], [0, 1, 1])
    with pytest.raises(AssertionError, match="distinct"):
        _tree([0, 5, 5], [-1, 0, 0], [0, 1, 1])
    _tree([0, 5, 5], [-1, 0, 1], [0, 1, 2])  # equal tokens on different parents are fine


def test_each_invariant_check_flags_its_own_breach():
    """The four verdicts (root, topological order, depths, distinct siblings), one breach at a time."""
    cases = [(([0, 1, 2], [-1, 2, 0], [0, 2, 1]), (True, False, True, True)),
             (([0, 1], [0, 0], [0, 1]), (False, True, True, True)),
             (([0, 1, 2], [-1, 0, 1], [0, 1, 1]), (True, True, False, True)),
             (([0, 5, 5], [-1, 0, 0], [0, 1, 1]), (True, True, True, False)),
             (([0, 5, 5], [-1, 0, 1], [0, 1, 2]), (True, True, True, True)),
             (([-1, 2], [-1, 0], [0, 1]), (False, True, True, True))]
    for (tokens, parents, depths), verdicts in cases:
        assert DraftTree._invariants(tokens, parents, depths) == verdicts, (tokens, parents, depths)


def test_paths_positions_and_constructors():
    assert HAND.leaf_paths() == [[0, 2], [0, 1, 3, 4], [0, 1, 5]]
    assert HAND.path_to(4).tolist() == [0, 1, 3, 4]
    assert HAND.path_to(0).tolist() == [0]
    assert HAND.positions(10).tolist() == [10, 11, 11, 12, 13, 12]
    root = DraftTree.root_only(torch.tensor(7))
    assert root.size == 1 and root.tokens.tolist() == [7] and root.leaf_paths() == [[0]]
    chain = DraftTree.chain(3, torch.tensor([5, 1]), torch.tensor([-0.5, -0.25]))
    assert chain.tokens.tolist() == [3, 5, 1] and chain.parents.tolist() == [-1, 0, 1]
    assert chain.depths.tolist() == [0, 1, 2] and chain.scores.tolist() == [0.0, -0.5, -0.75]
    host = DraftTree.host_chain([3, 5, 1])  # lookup's chains: host ids, no scores
    same = DraftTree.chain(3, torch.tensor([5, 1]), torch.zeros(2))
    for name in ("tokens", "parents", "depths", "scores"):
        a, b = getattr(host, name), getattr(same, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    DraftTree(host.tokens, host.parents, host.depths, host.scores)  # the full checks pass on what they build
    # these constructors skip the shape checks their shapes make true, not the token check
    with pytest.raises(AssertionError, match="tokens"):
        DraftTree.chain(3, torch.tensor([5, -1]), torch.zeros(2))
    with pytest.raises(AssertionError, match="tokens"):
        DraftTree.root_only(-2)
    with pytest.raises(ValueError, match="one shape"):
        DraftTree.chain(3, torch.tensor([5, 1]), torch.zeros(3))


def _hand_expansion():
    """Three levels, top_k 2, on hand-built tables (probabilities chosen to multiply exactly)."""
    cands, frontier = expand_root(_row({1: 0.4, 3: 0.3}), 2)  # c0 = 1 (.4), c1 = 3 (.3)
    level2 = torch.stack([_row({2: 0.5, 5: 0.25}), _row({6: 0.9, 0: 0.05})])
    cands, frontier2 = expand_level(cands, frontier, level2, 2)  # c2..c5
    level3 = torch.stack([_row({7: 0.5, 1: 0.4}), _row({4: 0.6, 3: 0.3})])  # rows: c4, c2
    cands, frontier3 = expand_level(cands, frontier2, level3, 2)  # c6..c9
    return cands, frontier, frontier2, frontier3


def test_eagle2_expansion_gives_the_expected_candidates_and_frontiers():
    cands, frontier, frontier2, frontier3 = _hand_expansion()
    assert frontier.tolist() == [0, 1]
    assert frontier2.tolist() == [4, 2]  # .27 (3 -> 6) and .2 (1 -> 2)
    assert frontier3.tolist() == [6, 8]  # .135 (6 -> 7) and .12 (2 -> 4)
    assert cands.tokens.tolist() == [1, 3, 2, 5, 6, 0, 7, 1, 4, 3]
    assert cands.parents.tolist() == [-1, -1, 0, 0, 1, 1, 4, 4, 2, 2]
    assert cands.depths.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    probs = [0.4, 0.3, 0.2, 0.1, 0.27, 0.015, 0.135, 0.108, 0.12, 0.06]
    torch.testing.assert_close(cands.scores, torch.tensor(probs).log())


def test_rerank_keeps_the_best_in_topological_order():
    cands, *_ = _hand_expansion()
    tree = rerank(cands, 11, total_tokens=6)  # best 5: c0 .4, c1 .3, c4 .27, c2 .2, c6 .135
    assert tree.tokens.tolist() == [11, 1, 3, 6, 2, 7]
    assert tree.parents.tolist() == [-1, 0, 0, 2, 1, 3]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3]
    torch.testing.assert_close(tree.scores, torch.tensor([1, 0.4, 0.3, 0.27, 0.2, 0.135]).log())
    assert rerank(cands, 11, total_tokens=1).size == 1
    assert rerank(cands, 11, total_tokens=100).size == 11


def test_rerank_breaks_exact_ties_towards_shallower_nodes():
    # candidates listed deepest first; all scores equal (children with log-prob 0)
    depths = [3, 2, 2, 1, 1]
    parents = [1, 4, 3, -1, -1]  # c0 <- c1 <- c4 ; c2 <- c3
    tokens, scores = torch.tensor([5, 4, 3, 2, 1]), torch.full((5,), -0.7)
    cands = Candidates(tokens, torch.tensor(parents), torch.tensor(depths), scores)
    for total in range(1, 8):
        tree = rerank(cands, 0, total)  # DraftTree asserts parents[i] < i, so closure holds
        assert tree.size == min(total, 6)
        assert sorted(tree.depths.tolist()) == tree.depths.tolist() == [0, 1, 1, 2, 2, 3][: tree.size]
    assert rerank(cands, 0, 3).tokens.tolist() == [0, 2, 1]


def test_rerank_closure_with_zero_logprob_children_in_real_expansions():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        cands, frontier = expand_root(torch.randn(V, generator=gen).log_softmax(-1), 3)
        for _level in range(4):
            logits = torch.randn(frontier.shape[0], V, generator=gen)
            logits[0] = float("-inf")
            logits[0, 2] = 0.0  # this frontier node's best child has log-prob exactly 0
            cands, frontier = expand_level(cands, frontier, logits.log_softmax(-1), 3)
        for total in range(1, cands.size + 2):
            tree = rerank(cands, 0, total)
            assert tree.size == min(total, cands.size + 1)


def test_static_shape_levels_and_fill():
    shape = StaticShape.from_paths([(0, 0, 0), (1, 0), (0,), (0, 1), (1,), (0, 0)])
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert shape.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert (shape.size, shape.depth) == (7, 3)
    l1, l2, l3 = shape.levels
    assert (l1.expand, l1.rows, l1.ranks, l1.first) == ((0,), (0, 0), (0, 1), 1)
    assert (l2.expand, l2.rows, l2.ranks, l2.first) == ((1, 2), (0, 0, 1), (0, 1, 0), 3)
    assert (l3.expand, l3.rows, l3.ranks, l3.first) == ((3,), (0,), (0,), 6)
    rows = {0: _row({4: 0.5, 2: 0.25}), 1: _row({1: 0.5, 7: 0.4}), 2: _row({3: 0.8}), 3: _row({6: 0.5})}
    scores = torch.zeros(1)
    tokens = []
    for level in shape.levels:
        t, s = fill_level(level, scores[list(level.expand)], torch.stack([rows[i] for i in level.expand]))
        tokens.append(t)
        scores = torch.cat([scores, s])
    tree = shape.tree(9, torch.cat(tokens), scores[1:])
    assert tree.tokens.tolist() == [9, 4, 2, 1, 7, 3, 6]
    assert tree.parents.tolist() == list(shape.parents)
    torch.testing.assert_close(tree.scores, torch.tensor([1, 0.5, 0.25, 0.25, 0.2, 0.2, 0.125]).log())


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (0, 1, 2), (0, 1, 3)], r"\(0, 1, 2\) needs its prefix \(0, 1\)"),
        ([(1, 0)], r"needs its prefix \(1,\)"),
        ([(0,), (0,)], "more than once"),
        ([(0,), (-1,)], "ranks >= 0"),
        ([(0,), ()], "non-empty"),
        ([], "non-empty"),
    ],
)
def test_static_shape_rejects_bad_paths(paths, message):
    with pytest.raises(ConfigError, match=message):
        StaticShape.from_paths(paths)


def test_default_static_tree_is_valid_and_is_the_most_probable_set():
    shape = StaticShape.from_paths(DEFAULT_STATIC_PATHS)
    assert 25 <= shape.size <= 30 and shape.depth == 5
    def log_p(path):  # the model's path probability: rank r has probability 0.7 * 0.3**r
        return len(path) * math.log(0.7) + sum(path) * math.log(0.3)

    chosen = set(DEFAULT_STATIC_PATHS)
    others = [
        p for d in range(1, 6) for p in itertools.product(range(4), repeat=d) if p not in chosen
    ]
    assert min(map(log_p, chosen)) >= max(map(log_p, others)) - 1e-12
    assert max(len(p) for p in most_probable_paths(25, 0.3, 3)) == 3


def test_fixed_depth_stops_at_depth_without_syncs():
    policy = FixedDepth(3)
    scores = torch.zeros(2)
    assert [policy.continue_after(level, scores) for level in (1, 2, 3)] == [True, True, False]
    assert policy.syncs == 0


def test_ddd_stops_at_a_check_level_with_one_sync_per_check():
    policy = DynamicDepth(threshold=-0.3, check_depths=(5, 7, 9), max_depth=11)
    above = torch.tensor([0.5, 0.3]).log()  # logsumexp = log .8 = -0.22
    below = torch.tensor([0.4, 0.3]).log()  # logsumexp = log .7 = -0.36
    for level in range(1, 5):
        assert policy.continue_after(level, below)  # not a check level: no look, no sync
    assert policy.syncs == 0
    assert policy.continue_after(5, above) and policy.syncs == 1
    assert policy.continue_after(6, below) and policy.syncs == 1
    assert not policy.continue_after(7, below) and policy.syncs == 2


def test_ddd_stops_at_max_depth():
    policy = DynamicDepth(threshold=-0.3, check_depths=(5, 7, 9), max_depth=11)
    confident = torch.zeros(1)
    levels = 1
    while policy.continue_after(levels, confident):
        levels += 1
    assert levels == 11 and policy.syncs == 3


def test_drafting_loop_with_ddd_stops_at_the_first_check_for_a_random_draft():
    gen = torch.Generator().manual_seed(3)
    policy = DynamicDepth(threshold=-0.3, check_depths=(2, 3), max_depth=5)
    cands, frontier = expand_root(torch.randn(V, generator=gen).log_softmax(-1), 3)
    level = 1
    while policy.continue_after(level, cands.scores[frontier]):
        child_logprobs = torch.randn(frontier.shape[0], V, generator=gen).log_softmax(-1)
        cands, frontier = expand_level(cands, frontier, child_logprobs, 3)
        level += 1
    assert torch.logsumexp(cands.scores[frontier], 0) < -0.3  # a random draft keeps little mass
    assert (level, policy.syncs, cands.size) == (2, 1, 12)
    tree = rerank(cands, 0, 10)
    assert tree.size == 10 and tree.depths.max().item() == 2


def test_make_depth_policy_follows_the_tree_config():
    assert make_depth_policy(TreeConfig(depth=4)).depth == 4
    assert make_depth_policy(TreeConfig(shape="chain", depth=3)).depth == 3
    assert make_depth_policy(TreeConfig(shape="static")).depth == 5
    assert make_depth_policy(TreeConfig(shape="static", static_paths=((0,), (0, 0)))).depth == 2
    cfg = TreeConfig(depth_policy="ddd", ddd_threshold=-0.5, ddd_check_depths=(2,), max_depth=4)
    ddd = make_depth_policy(cfg)
    assert isinstance(ddd, DynamicDepth)
    assert (ddd.threshold, ddd.check_depths, ddd.max_depth) == (-0.5, frozenset({2}), 4)
    with pytest.raises(ConfigError, match="dynamic"):
        make_depth_policy(TreeConfig(shape="chain", depth_policy="ddd"))


def test_with_chain_follows_matching_nodes_and_appends_the_rest():
    # root 1 -> 2 -> 3, and root -> 4
    tree = DraftTree(torch.tensor([1, 2, 4, 3]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]),
                     torch.tensor([0.0, -0.1, -0.5, -0.3]))
    merged, added = tree.with_chain([2, 3, 7, 8])  # follows 2 -> 3, then appends 7 -> 8 under node 3
    assert added == 2 and merged.size == 6
    assert merged.tokens.tolist() == [1, 2, 4, 3, 7, 8]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert merged.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert merged.scores.tolist()[4:] == pytest.approx([-0.3, -0.3])  # scored like their parent
    branch, added = tree.with_chain([4, 9])  # a new child under the existing node 4
    assert added == 1 and branch.parents.tolist()[-1] == 2 and branch.depths.tolist()[-1] == 2
    new_root_child, added = tree.with_chain([5, 6], max_depth=1)  # depth-limited: only the first token fits
    assert added == 1 and new_root_child.tokens.tolist()[-1] == 5 and new_root_child.parents.tolist()[-1] == 0
    for chain in ([], [2, 3]):  # nothing new: the same tree object
        same, added = tree.with_chain(chain)
        assert same is tree and added == 0

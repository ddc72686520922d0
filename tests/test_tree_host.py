"""The host-list tree builder (tree/host.py) against the tensor one (tree/build.py), the C top-k
of the draft's log-probs against torch's, and a CPU drafter's host path against its tensor path."""

from __future__ import annotations

import pytest
import torch

from ddspec import native
from ddspec.config import TreeConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.tree import expand_level, expand_root, rerank
from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, flat_cost, linear_cost
from ddspec.tree.host import HostCandidates

V = 50


def _same_tree(a, b) -> None:
    for name in ("tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("top_k, levels", [(1, 5), (3, 4), (6, 3)])
def test_host_expansion_and_rerank_equal_the_tensor_ones(top_k, levels):
    gen = torch.Generator().manual_seed(top_k)
    for _ in range(10):
        root = torch.randn(V, generator=gen).log_softmax(-1)
        cands, frontier = expand_root(root, top_k)
        values, ids = root.topk(top_k)
        host = HostCandidates(ids.tolist(), values.tolist())
        host_frontier = list(range(top_k))
        for _level in range(levels):
            logprobs = torch.randn(len(host_frontier), V, generator=gen).log_softmax(-1)
            values, ids = logprobs.topk(top_k, dim=-1)
            cands, frontier = expand_level(cands, frontier, logprobs, top_k)
            host_frontier = host.expand(host_frontier, values.tolist(), ids.tolist(), top_k)
            assert host_frontier == frontier.tolist()
        assert host.tokens == cands.tokens.tolist() and host.parents == cands.parents.tolist()
        assert host.depths == cands.depths.tolist() and host.scores == cands.scores.tolist()
        for total in (1, 2, 5, 9, cands.size + 1, cands.size + 5):
            tree, added = host.tree(7, total)
            assert added == 0
            _same_tree(tree, rerank(cands, 7, total))


def test_host_tree_maps_draft_ids_then_merges_the_chain_like_with_chain():
    gen = torch.Generator().manual_seed(3)
    root = torch.randn(V, generator=gen).log_softmax(-1)
    cands, frontier = expand_root(root, 3)
    values, ids = root.topk(3)
    host = HostCandidates(ids.tolist(), values.tolist())
    logprobs = torch.randn(3, V, generator=gen).log_softmax(-1)
    cands, _ = expand_level(cands, frontier, logprobs, 3)
    values, ids = logprobs.topk(3, dim=-1)
    host.expand([0, 1, 2], values.tolist(), ids.tolist(), 3)
    to_target = torch.arange(V) * 2 + 1000  # draft id -> target id
    ref = rerank(cands, 7, 6)
    ref = type(ref)(torch.cat([ref.tokens[:1], to_target[ref.tokens[1:]]]), ref.parents, ref.depths, ref.scores)
    first = int(ref.tokens[1])
    for chain, depth in (([first, 5, 6], None), ([9, 9, 9, 9], 2), ([], None)):
        want, want_added = ref.with_chain(chain, depth)
        tree, added = host.tree(7, 6, lambda t: to_target[t].tolist(), chain, depth)
        assert added == want_added
        _same_tree(tree, want)


def _frontier_keep_reference(candidate_scores: torch.Tensor, frontier: torch.Tensor, size: int) -> torch.Tensor:
    """[k] bool, the obvious tensor reading of CostAwarePolicy.frontier_rows: rank every candidate
    (score descending, ties by index), keep the frontier nodes ranked below ``size`` and the best one."""
    m = candidate_scores.numel()
    if size >= m:
        return torch.ones(frontier.shape, dtype=torch.bool)
    order = torch.argsort(candidate_scores, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(m)
    keep = rank[frontier] < size
    keep[rank[frontier].argmin()] = True
    return keep


def test_policys_frontier_rows_equal_a_tensor_reference():
    gen = torch.Generator().manual_seed(5)
    cost = CostModel(linear_cost(2.0, 0.05), draft_root_ms=0.1, draft_level_ms=0.2, other_ms=0.1)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=6, max_tokens=20)
    for _ in range(50):
        m = int(torch.randint(4, 30, (1,), generator=gen))
        scores = (-torch.rand(m, generator=gen) * 5).float()
        scores[int(torch.randint(0, m, (1,), generator=gen))] = scores[0]  # a tie now and then
        frontier = torch.randperm(m, generator=gen)[: int(torch.randint(1, m + 1, (1,), generator=gen))]
        policy.next_size = int(torch.randint(1, m + 3, (1,), generator=gen))
        keep = _frontier_keep_reference(scores, frontier, policy.next_size)
        rows = policy.frontier_rows(scores.tolist(), frontier.tolist())
        assert rows == torch.nonzero(keep).flatten().tolist()


@pytest.mark.skipif(not native.available(), reason="the C kernels are not built here")
@pytest.mark.parametrize("rows, width, extra, k, scale", [(1, 8192, 170, 10, 1 / 0.79), (3, 100, 0, 1, 1.0),
                                                          (5, 37, 5, 42, 2.0), (2, 8, 3, 11, 0.5)])
def test_top_logprobs_equal_log_softmax_and_topk(rows, width, extra, k, scale):
    gen = torch.Generator().manual_seed(rows * width)
    a = torch.randn(rows, width, generator=gen) * 4
    b = torch.randn(rows, extra, generator=gen) * 4
    values, ids = native.top_logprobs(a, b if extra else None, scale, k)
    ref = torch.log_softmax(torch.cat([a, b], -1) * scale, -1).topk(k, dim=-1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(values, ref.values, rtol=0, atol=2e-5)


@pytest.mark.skipif(not native.available(), reason="the C kernels are not built here")
def test_top_logprobs_ties_go_to_the_earlier_column_and_bad_sizes_are_refused():
    a = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    b = torch.tensor([[3.0, -float("inf")]])
    values, ids = native.top_logprobs(a, b, 1.0, 5)
    assert ids.tolist() == [[1, 2, 4, 5, 0]]
    assert values[0, 0] == values[0, 3] and bool((values[0, :4] > values[0, 4]).all())
    with pytest.raises(ValueError, match="bad sizes"):
        native.top_logprobs(a, b, 1.0, 8)


@pytest.mark.parametrize("method", ["eagle2", "ddspec"])
def test_a_cpu_drafters_host_path_grows_the_tensor_paths_trees(tiny_targets, method):
    """The same drafter state, one proposal through _propose_dynamic (tensors) and one through
    _propose_dynamic_host: the same tree (scores to the C normaliser's last bits)."""
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=2).eval().requires_grad_(False)
    cfg = TreeConfig(top_k=4, depth=4, total_tokens=14, max_depth=5, ddd_check_depths=(2, 4),
                     depth_policy="cost" if method == "ddspec" else "fixed")
    policy = None
    if method == "ddspec":  # verifying is free and drafting nearly so: the policy grows a tree
        cost = CostModel(flat_cost(5.0), draft_root_ms=0.01, draft_level_ms=0.01, other_ms=0.01)
        policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    drafter = EagleDrafter(head, target, cfg, cost_policy=policy)
    prompt = torch.tensor([5, 17, 33, 8, 90, 4, 4, 61])
    target.reset(64)
    out = target.forward(prompt, torch.arange(prompt.numel()), None, drafter.hidden_layers, last_logits=True)
    target.commit(torch.arange(prompt.numel()))
    drafter.reset(64)
    root = out.logits[-1].argmax()
    drafter.prefill(prompt, out, root)
    drafter._flush_pending()
    drafter._committed = drafter.cache.length
    position = prompt.numel()
    drafter._room, drafter._chain = 40, []
    trees = []
    for grow in (drafter._propose_dynamic, drafter._propose_dynamic_host):
        if policy is not None:
            policy.child_logprob, policy.levels = -1.0, 0
        trees.append(grow(root, position))
        drafter.cache.truncate(position)
    a, b = trees
    assert a.size > 2
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=1e-5)

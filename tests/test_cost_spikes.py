"""Learned draft costs ignore an isolated slow step but follow a lasting change."""

from __future__ import annotations

import pytest

from ddspec.tree.cost import CostModel, LearnedCosts, linear_cost

BASE = CostModel(verify_ms=linear_cost(20.0, 1.0), draft_root_ms=0.5, draft_level_ms=3.0, other_ms=1.0)


def drafted(costs: LearnedCosts, levels: int, draft_ms: float) -> None:
    costs.observe(tree_size=4, levels=levels, draft_ms=draft_ms, verify_ms=25.0, gap_ms=0.5, drafted=True)


def test_one_slow_draft_step_does_not_make_levels_dear():
    costs = LearnedCosts(BASE)
    drafted(costs, 1, 0.5)
    drafted(costs, 3, 0.5 + 2 * 60.0)  # a first call at a new shape: 60 ms a level, once
    assert costs.current.draft_level_ms == pytest.approx(3.0)
    for _ in range(5):
        drafted(costs, 3, 0.5 + 2 * 2.5)
    assert costs.current.draft_level_ms == pytest.approx(2.5, rel=0.05)


def test_a_lasting_change_is_learned_after_three_steps():
    costs = LearnedCosts(BASE)
    drafted(costs, 1, 0.5)
    for i in range(3):
        drafted(costs, 3, 0.5 + 2 * 12.0)
        assert (costs.current.draft_level_ms > 6.0) == (i == 2)
    drafted(costs, 1, 0.5 * 10)  # the root alike
    assert costs.current.draft_root_ms == pytest.approx(0.5)
    drafted(costs, 1, 0.2)  # a faster one counts at once
    assert costs.current.draft_root_ms < 0.5


def test_a_dearer_root_does_not_make_unseen_levels_dearer():
    """A real root also pays the policy's bookkeeping (8x the calibration's bare root here): levels
    not yet observed keep their calibrated cost instead of growing 8x (and never being drafted)."""
    costs = LearnedCosts(BASE)
    for _ in range(3):
        drafted(costs, 1, 4.0)
    assert costs.current.draft_root_ms == pytest.approx(4.0, rel=0.3)
    assert costs.current.draft_level_ms == pytest.approx(3.0)
    cheaper = LearnedCosts(BASE)
    drafted(cheaper, 1, 0.05)  # a calibration made on a busy machine: levels follow the root down
    assert cheaper.current.draft_level_ms == pytest.approx(0.3)

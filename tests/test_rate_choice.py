"""RateChoice: draft or not from what each kind of step gave, the worse tried again with a back-off."""

from __future__ import annotations

from ddspec.tree.choice import RateChoice


def play(choice: RateChoice, steps: int, drafted: tuple[float, float], plain: tuple[float, float]) -> list[bool]:
    picks = []
    for _ in range(steps):
        picks.append(choice.choose())
        choice.observe(picks[-1], *(drafted if picks[-1] else plain))
    return picks


def test_windows_of_the_worse_kind_grow_apart_while_it_stays_worse():
    picks = play(RateChoice(explore_every=64, explore_steps=4, max_backoff=8, decay=0.95), 3000,
                 drafted=(20.0, 0.2), plain=(16.0, 0.1))  # plain: 160 tokens/s against drafting's 100
    assert picks[:8] == [True] * 4 + [False] * 4  # 4 steps of each kind first, drafting first
    starts = [i for i in range(9, len(picks)) if picks[i] and not picks[i - 1]]
    assert all(picks[s:s + 4] == [True] * 4 and not picks[s + 4] for s in starts)  # windows of 4 steps
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # each wait (64 x 2, x 4, x 8, then x 8) counts the steps after a window of 4
    assert gaps[:3] == [128 + 3, 256 + 3, 512 + 3] and set(gaps[3:]) == {512 + 3}
    assert sum(picks) < 0.02 * len(picks)


def test_the_better_kind_wins_and_a_change_of_costs_is_followed():
    choice = RateChoice(explore_every=8)
    picks = play(choice, 200, drafted=(3.0, 100.0), plain=(1.0, 40.0))  # drafting 0.03 tokens/ms > 0.025
    assert sum(picks[2:]) > 0.9 * 198
    later = play(choice, 400, drafted=(3.0, 200.0), plain=(1.0, 40.0))  # drafting got dearer: plain wins
    assert sum(later[-100:]) < 10


def test_a_margin_keeps_the_kind_in_use_until_the_other_is_clearly_better():
    choice = RateChoice(explore_every=8, margin=0.05, decay=0.5)
    play(choice, 2, drafted=(10.0, 1.0), plain=(10.0, 1.0))
    assert sum(play(choice, 100, drafted=(10.0, 1.0), plain=(10.3, 1.0))) >= 95  # 3% better: drafting stays
    assert sum(play(choice, 300, drafted=(10.0, 1.0), plain=(11.0, 1.0))[-100:]) <= 3  # 10% better: plain
    assert sum(play(choice, 300, drafted=(10.3, 1.0), plain=(10.0, 1.0))[-100:]) <= 3  # 3% worse: plain stays


def test_a_draft_margin_makes_drafting_earn_its_place():
    """With plain steps in use at first and a draft margin, drafting 8% faster stays held back (it is
    only tried now and then); 20% faster it is taken, and once in use it stays while it is not the worse."""
    choice = RateChoice(explore_every=8, margin=0.05, decay=0.5, draft_margin=0.05, in_use=False)
    picks = play(choice, 200, drafted=(10.8, 1.0), plain=(10.0, 1.0))
    assert picks[0] and sum(picks[10:]) <= 0.15 * 190  # explorations only
    assert sum(play(choice, 300, drafted=(12.0, 1.0), plain=(10.0, 1.0))[-100:]) >= 85
    assert sum(play(choice, 300, drafted=(10.1, 1.0), plain=(10.0, 1.0))[-100:]) >= 85  # in use: stays
    assert sum(play(choice, 300, drafted=(9.0, 1.0), plain=(10.0, 1.0))[-100:]) <= 15
    # the default (no draft margin, nothing in use): a tie within the margin drafts
    assert sum(play(RateChoice(explore_every=8, margin=0.05, decay=0.5), 100, drafted=(10.0, 1.0),
                    plain=(10.3, 1.0))[10:]) >= 80

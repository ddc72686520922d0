"""RateChoice: draft or not from what each kind of step gave, the worse tried again with a back-off;
PairedRateChoice: the same, the kinds compared where they meet."""

from __future__ import annotations

import math

from ddspec.tree.choice import PairedRateChoice, RateChoice


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


def play_on(choice: RateChoice, steps: int, drafted: float, plain: float, speed) -> list[bool]:
    """Like play, one token a step at ``drafted`` / ``plain`` tokens per second times the machine's
    ``speed(step)``."""
    picks = []
    for i in range(steps):
        picks.append(choice.choose())
        choice.observe(picks[-1], 1.0, 1.0 / ((drafted if picks[-1] else plain) * speed(i)))
    return picks


def batch_choice(cls):
    return cls(explore_every=64, explore_steps=4, max_backoff=4, decay=0.95, margin=0.05, draft_margin=0.05,
               in_use=False)


def test_pairs_compare_the_last_steps_of_one_kind_with_the_first_of_the_next():
    choice = PairedRateChoice(explore_every=64, explore_steps=2)
    for drafted, seconds in [(True, 1.0), (True, 2.0), (True, 1.0), (False, 0.5), (False, 1.5), (False, 9.0)]:
        choice.observe(drafted, 1.0, seconds)
    # drafted steps 2 and 3 (2 tokens in 3 s) against plain steps 1 and 2 (2 tokens in 2 s)
    assert choice.pairs == [math.log((2 / 3) / (2 / 2)), 1.0]
    assert math.isclose(choice.ratio(), 2 / 3)
    choice.observe(True, 1.0, 1.0)  # a run shorter than explore_steps is paired as it is: one drafted step
    choice.observe(False, 1.0, 1.0)  # against the plain run's last two (2 tokens in 10.5 s)
    assert choice.pairs[1] == 0.5 + 1.0  # decayed by half a pair
    assert math.isclose(choice.pairs[0], 0.5 * math.log(2 / 3) + math.log(1.0 / (2 / 10.5)))


def test_a_machine_slowing_down_does_not_make_the_kind_measured_earlier_look_better():
    """Drafting 5% slower than plain steps throughout; the machine's speed drops by a third at step
    300 and again at 900. With the plain rates, drafting (last measured while the machine was faster)
    looks better after each drop until it is measured again, and takes steps it loses; compared
    where the kinds meet it is only ever tried."""
    speed = lambda i: 1.5 if i < 300 else 1.0 if i < 900 else 0.67  # noqa: E731
    plain_rates = play_on(batch_choice(RateChoice), 1500, drafted=9.5, plain=10.0, speed=speed)
    paired = play_on(batch_choice(PairedRateChoice), 1500, drafted=9.5, plain=10.0, speed=speed)
    tried = 4 + 4 * 7  # the first 4 steps, then windows of 4 after 128, 256, 256, ... steps
    assert sum(paired) <= tried
    assert sum(plain_rates) > sum(paired) + 20


def test_paired_choice_takes_drafting_where_it_pays_and_drops_it_where_it_stops_paying():
    """The kind in use is compared again at the next window of the other (at most 64 x 4 steps on):
    a change of costs is followed within that."""
    speed = lambda i: 1.0 + 0.3 * math.sin(i / 50)  # noqa: E731  the machine's speed wandering
    choice = batch_choice(PairedRateChoice)
    assert sum(play_on(choice, 1500, drafted=13.0, plain=10.0, speed=speed)[-500:]) >= 490
    later = play_on(choice, 1500, drafted=8.0, plain=10.0, speed=speed)
    dropped = later.index(False, 8)  # (the first steps may end a window of plain steps)
    assert dropped <= 256 and sum(later[dropped + 8:]) <= 4 * 6

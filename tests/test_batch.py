"""Continuous batching: several sequences' forwards in one (NativeLlama.forward_many), the engine's
generation driven from outside (Engine.steps), the batch worker's load-aware policy, and the server
decoding several requests at once (the whole server suite also runs batched: test_server.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ddspec.config import SamplingConfig, StopConfig
from ddspec.engine import Chunk, Engine, Forward, Request
from ddspec.methods import make_drafter
from test_models import ancestor_mask, random_tree
from test_spec_engine import eagle

needs_kernels = pytest.mark.skipif(not __import__("ddspec.native").native.available(),
                                   reason="the C kernels cannot be built here")


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "gemma3", "llama-int8"])
def test_forward_many_equals_each_sequences_own_forward_bit_for_bit(tiny_dirs, tmp_path, family, monkeypatch):
    """A prompt, a tree, a chain and four single tokens (one with no key before it), of seven
    sequences at different lengths, in one call: each gets exactly the logits, features, hidden
    states and argmax of its own forward. The single tokens' attention runs as one pass over all of
    them (sliding windows in Gemma 3's local layers; an fp16 cache with 8-bit activations)."""
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    monkeypatch.setenv("DDSPEC_KERNEL", "native")
    folder = tiny_dirs["llama"] if family.startswith("llama") else make_tiny_model_dir(
        tmp_path / family, family, seed=3, layers=6, sliding_window=8)
    if family == "llama-int8":
        from test_native_kernels import _quantise_dense

        _quantise_dense(monkeypatch)
        model = load_target(str(folder), impl="native", activations="int8")
    else:
        model = load_target(str(folder), impl="native")
    gen = torch.Generator().manual_seed(5)
    vocab = model.info.vocab_size
    prefixes = [0, 9, 17, 30, 5, 0, 22]
    solo, batched = [model.session() for _ in prefixes], [model.session() for _ in prefixes]
    for sessions in (solo, batched):
        for s, p in zip(sessions, prefixes):
            s.reset(64)
            if p:
                s.forward(torch.arange(p) % vocab, torch.arange(p))
                s.commit(torch.arange(p))
    parents, depths = random_tree(7, gen)
    one = [(torch.randint(0, vocab, (1,), generator=gen), torch.tensor([p]), None, h, False)
           for p, h in ((30, (2,)), (5, ()), (0, (0, 1)), (22, ()))]
    calls = [
        (torch.randint(0, vocab, (12,), generator=gen), torch.arange(12), None, (0, 1), True),  # a prompt
        (torch.randint(0, vocab, (7,), generator=gen), 9 + depths, ancestor_mask(parents), (1,), False),  # a tree
        (torch.randint(0, vocab, (3,), generator=gen), 17 + torch.arange(3), torch.ones(3, 3).tril().bool(), (), False),
        *one,  # single tokens
    ]
    want = [s.forward(t, p, m, h, last_logits=last) for s, (t, p, m, h, last) in zip(solo, calls)]
    got = model.forward_many([(s, *c) for s, c in zip(batched, calls)])
    for w, g in zip(want, got):
        assert torch.equal(w.logits, g.logits) and torch.equal(w.features, g.features)
        assert w.hidden_states.keys() == g.hidden_states.keys()
        assert all(torch.equal(w.hidden_states[k], g.hidden_states[k]) for k in w.hidden_states)
        assert (w.argmax is None) == (g.argmax is None) and (w.argmax is None or torch.equal(w.argmax, g.argmax))
    assert [s.cache_length for s in batched] == [s.cache_length for s in solo]


def drive(model, runs: list[tuple[Engine, list[int], StopConfig, int]]) -> list[list[int]]:
    """Decode runs together as the batch worker does: run i joins at step ``join``; every step
    advances each generation to its next forward and runs those forwards in one forward_many."""
    out = [[] for _ in runs]
    live: dict[int, tuple] = {}
    step = 0
    while step == 0 or live or any(j >= step for *_, j in runs):
        for i, (engine, prompt, stop, join) in enumerate(runs):
            if join == step:
                live[i] = (engine.steps(prompt, stop), None)
        pending = {}
        for i, (steps, value) in list(live.items()):
            try:
                item = steps.send(value) if value is not None else next(steps)
                while isinstance(item, Chunk):
                    out[i] += item.token_ids
                    item = next(steps)
                pending[i] = item
            except StopIteration:
                del live[i]
        if pending:
            keys = list(pending)
            outs = model.forward_many([(runs[i][0].target, f.tokens, f.positions, f.mask, f.hidden_layers,
                                        f.last_logits) for i in keys for f in (pending[i],)])
            for i, o in zip(keys, outs):
                live[i] = (live[i][0], o)
        step += 1
    return out


@needs_kernels
def test_requests_joining_and_leaving_each_equal_their_solo_run(tiny_targets):
    """Five generations of different methods, lengths and sampling join a batch at different steps
    (one after a long prompt): each one's tokens equal its own run alone."""
    model = tiny_targets[("llama", "native")]
    prompts = [[5, 17, 33, 8, 90], [40, 41, 42] * 50, [7] * 9, [100, 3, 64, 12, 99, 1, 2, 77], [12, 13]]
    settings = [("vanilla", SamplingConfig(), 20, 0), ("eagle2", SamplingConfig(), 30, 0),
                ("lookup", SamplingConfig(), 12, 2), ("ddspec", SamplingConfig(temperature=0.8, seed=3), 25, 3),
                ("ddd", SamplingConfig(temperature=0.7, top_p=0.9, seed=4), 18, 9)]

    def engine(target, method, sampling):
        drafter = None if method == "vanilla" else (make_drafter(method, target, None) if method == "lookup"
                                                    else eagle(target, method))
        return Engine(target, drafter, sampling)

    solo = [engine(model, m, s).generate(p, StopConfig(max_new_tokens=n, stop_on_eos=False)).token_ids
            for p, (m, s, n, _) in zip(prompts, settings)]
    runs = [(engine(model.session(), m, s), p, StopConfig(max_new_tokens=n, stop_on_eos=False), join)
            for p, (m, s, n, join) in zip(prompts, settings)]
    assert drive(model, runs) == solo


def test_the_policy_prices_a_node_for_the_whole_batch():
    """Beside other sequences the cost-aware policy maximises the batch's tokens per ms: the same
    drafted scores give a smaller tree as the other rows grow (a row costs every sequence's step)."""
    from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, linear_cost

    cost = CostModel(linear_cost(5.0, 0.4), draft_root_ms=0.3, draft_level_ms=0.3, other_ms=0.2)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=6, max_tokens=32)
    scores = [-0.05 * i for i in range(30)]
    sizes = []
    for rows, tokens in ((0, 0.0), (8, 12.0), (32, 48.0)):
        policy.batch = (rows, tokens, 2.0 * rows / 8)
        sizes.append(policy.best(scores, 3)[0])
    assert sizes[0] > sizes[1] > sizes[2] >= 1, sizes
    policy.batch = (32, 48.0, 8.0)
    assert policy.plain_rate() == pytest.approx(49.0 / policy._batch_plain_ms())


@needs_kernels
def test_a_short_request_behind_long_ones_is_not_starved(tiny_dirs):
    """Three long streams run; a short request that arrives after them finishes long before them."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from ddspec.models.loading import load_target
    from ddspec.server.build import LiveServer, make_service

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    with LiveServer(make_service(target, method="vanilla", max_tokens=400, batch=4)) as url:
        client = openai.OpenAI(api_key="unused", base_url=url + "/v1", max_retries=0, timeout=120)

        model = client.models.list().data[0].id

        def tokens(prompt: str, n: int) -> int:
            return client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0).usage.completion_tokens

        # prompts whose greedy answers run the whole 400 tokens (no end-of-text on the way)
        long = [p for p in (f"story {i}:" for i in range(40)) if tokens(p, 400) == 400][:3]
        assert len(long) == 3
        done: dict[str, float] = {}
        decoding = [threading.Event() for _ in long]

        def ask(prompt: str, n: int, started: threading.Event | None = None) -> None:
            for _ in client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True):
                if started is not None:
                    started.set()
            done[prompt] = time.perf_counter()

        threads = [threading.Thread(target=ask, args=(p, 400, e)) for p, e in zip(long, decoding)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in decoding)  # the short one arrives while all three decode
        ask("short", 8)
        for t in threads:
            t.join()
        assert all(done["short"] < done[p] for p in long), done


def test_requests_are_values_the_engine_keeps_none_of(tiny_targets):
    """One engine answers requests of different methods, sampling and prefix reuse one after another:
    each request's settings come with it, the engine's own defaults stay as they were, and every answer
    equals the one an engine built for that request alone gives."""
    target = tiny_targets[("llama", "native")]
    engine = Engine(target)
    stop = StopConfig(max_new_tokens=14, stop_on_eos=False)
    sampling = SamplingConfig(temperature=0.8, seed=2)
    lookup = make_drafter("lookup", target, None)
    requests = [Request([5, 6, 7, 5, 6, 7, 5], stop, drafter=lookup, method="lookup"),
                Request([9, 10, 11], stop, sampling),
                Request([5, 6, 7, 5, 6, 7, 5, 1], stop, drafter=lookup, method="lookup", reuse_prefix=True)]
    for req in requests:
        got = [t for c in engine.stream(req) for t in c.token_ids]
        alone = Engine(target, make_drafter(req.method, target, None), req.sampling).generate(req.prompt_ids, stop)
        assert got == alone.token_ids
    assert (engine.drafter, engine.sampling, engine.method, engine.reuse_prefix) == (None, SamplingConfig(), "vanilla",
                                                                                      False)


def concurrent_requests(url: str, max_tokens: list[int], method: str | None = None) -> None:
    """Concurrent greedy completions of different prompts from the server at ``url``, one per entry
    of ``max_tokens`` (with ``method``, or the server's own)."""
    import openai

    client = openai.OpenAI(api_key="unused", base_url=url + "/v1", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    extra = {} if method is None else {"extra_body": {"ddspec": {"method": method}}}
    threads = [threading.Thread(target=client.completions.create, kwargs=dict(
        model=model, prompt=f"tale {i}: " * (i + 1), max_tokens=n, temperature=0, **extra))
        for i, n in enumerate(max_tokens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@needs_kernels
def test_the_draft_or_not_choice_learns_from_decoding_steps_only(tiny_dirs, monkeypatch):
    """The batch worker's choice between drafting and plain steps learns from each step's tokens per
    second, except from steps that also ran a prompt's prefill chunk (rows that give no token) and
    from steps where it chose nothing (no sequence with a cost-aware policy: plain decoding's steps
    would count as steps with drafting allowed); each slot's policy is told the same of its steps."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from ddspec.models.loading import load_target
    from ddspec.server.batch import BatchWorker
    from ddspec.server.build import LiveServer, make_service
    from ddspec.tree.cost import CostAwarePolicy

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    last, learned = [None], []
    forward_many = target.forward_many
    monkeypatch.setattr(target, "forward_many", lambda calls: last.__setitem__(0, any(c[5] for c in calls))
                        or forward_many(calls))
    learn = BatchWorker._learn_rate
    monkeypatch.setattr(BatchWorker, "_learn_rate", lambda self, n, d, tokens, s, prefill=False: learned.append(
        (n, prefill, last[0])) or learn(self, n, d, tokens, s, prefill))
    observe_step, steps = CostAwarePolicy.observe_step, []
    monkeypatch.setattr(CostAwarePolicy, "observe_step", lambda self, *a, **k: steps.append(
        (self.beside_prefill, last[0])) or observe_step(self, *a, **k))
    with LiveServer(make_service(target, method="ddspec", head="random:1", max_tokens=200, batch=4)) as url:
        concurrent_requests(url, [200] * 4, "vanilla")
        assert learned == []  # plain decoding alone: nothing to choose, nothing learned
        # six requests on four slots: the two that wait are prefilled while the others decode
        concurrent_requests(url, [60, 200, 200, 100, 200, 200], "ddspec")
    assert all(told == ran for _, told, ran in learned)  # each step's learning was told whether it prefilled
    assert any(told for _, told, _ in learned) and any(n >= 2 and not told for n, told, _ in learned)
    # and so was each policy's (a step beside a prompt chunk teaches it no time)
    steps = [(told, ran) for told, ran in steps if ran is not None]  # (not the calibration's timing runs)
    assert all(told == ran for told, ran in steps) and any(told for told, _ in steps)


@needs_kernels
def test_trees_are_priced_beside_the_plain_batch_and_learned_with_the_rows_verified(tiny_dirs, monkeypatch):
    """Each slot's tree is priced beside the others as plain decoding (a row and a token each, no draft
    time), whatever they drafted the step before (priced beside those, all slots grew their trees
    together); a drafted step is learned from with the rows the forward really verified."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from ddspec.models.loading import load_target
    from ddspec.server.build import LiveServer, make_service
    from ddspec.tree.cost import CostAwarePolicy

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    rows, priced, learned = [(0, 0)], [], []
    forward_many = target.forward_many
    monkeypatch.setattr(target, "forward_many", lambda calls: rows.__setitem__(
        0, (len(calls), sum(c[1].shape[-1] for c in calls))) or forward_many(calls))
    draft_now, observe_step = CostAwarePolicy.draft_now, CostAwarePolicy.observe_step

    def priced_now(self, chain=None):
        priced.append((self.batch, rows[0][0]))
        return draft_now(self, chain)

    def learn(self, tokens, tree_size, *args, **kwargs):
        if self.drafting:
            learned.append((self.verified_beside + tree_size, rows[0]))
        return observe_step(self, tokens, tree_size, *args, **kwargs)

    monkeypatch.setattr(CostAwarePolicy, "draft_now", priced_now)
    monkeypatch.setattr(CostAwarePolicy, "observe_step", learn)
    # trees beside others must be drafted here, whatever this machine's costs forecast for them
    monkeypatch.setattr(CostAwarePolicy, "may_pay", lambda self: True)
    with LiveServer(make_service(target, method="ddspec", head="random:1", max_tokens=48, batch=4)) as url:
        concurrent_requests(url, [48] * 4)
    beside = [(batch, n) for batch, n in priced if batch[0]]
    assert beside and all(batch == (n - 1, float(n - 1), 0.0) for batch, n in beside)
    together = [(seen, total) for seen, (n, total) in learned if n > 1]
    assert together and any(total > n for _, (n, total) in learned if n > 1)  # others drafted beside it
    assert all(seen == total for seen, total in together)


@needs_kernels
def test_each_choice_learns_from_the_trees_drafted_under_it(tiny_dirs, monkeypatch):
    """A slot drafts its next tree as soon as its last one is verified, under the choice told for the
    step that verified it: what the next forward gives is learned for that choice, so a cycle with
    drafting held back never counts a drafted row (the choice here alternates every two steps)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from ddspec.models.loading import load_target
    from ddspec.server.batch import BatchWorker
    from ddspec.server.build import LiveServer, make_service
    from ddspec.tree.choice import RateChoice
    from ddspec.tree.cost import CostAwarePolicy

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    last, learned, turn = [None], [], [0]
    forward_many = target.forward_many
    monkeypatch.setattr(target, "forward_many", lambda calls: last.__setitem__(0, (
        len(calls), sum(c[1].shape[-1] for c in calls), any(c[5] for c in calls))) or forward_many(calls))
    monkeypatch.setattr(RateChoice, "choose", lambda self: turn.__setitem__(0, turn[0] + 1) or turn[0] % 4 < 2)
    monkeypatch.setattr(CostAwarePolicy, "may_pay", lambda self: True)  # trees drafted whatever the costs forecast
    learn = BatchWorker._learn_rate
    monkeypatch.setattr(BatchWorker, "_learn_rate", lambda self, n, d, tokens, s, prefill=False: learned.append(
        (d, last[0])) or learn(self, n, d, tokens, s, prefill))
    with LiveServer(make_service(target, method="ddspec", head="random:1", max_tokens=64, batch=4)) as url:
        concurrent_requests(url, [64] * 4)
    # the cycles the worker learns from (not those whose forward also ran a request's prompt chunk,
    # which happens where a request arrives while the others decode)
    held = [(n, rows) for drafted, (n, rows, prefill) in learned if not drafted and not prefill]
    assert held and all(rows == n for n, rows in held)  # one row per sequence: no tree drafted under it
    assert any(rows > n for drafted, (n, rows, _) in learned if drafted)


@needs_kernels
def test_drafting_is_not_tried_where_no_sequences_tree_or_chain_could_pay(tiny_dirs, monkeypatch):
    """The worker's rates say draft at every step, but no slot's policy finds a tree or a lookup
    chain that could pay at the batch's prices: every step is plain (one row per sequence) and
    learned as held back."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from ddspec.models.loading import load_target
    from ddspec.server.batch import BatchWorker
    from ddspec.server.build import LiveServer, make_service
    from ddspec.tree.choice import RateChoice
    from ddspec.tree.cost import CostAwarePolicy

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    last, learned, asked = [None], [], []
    forward_many = target.forward_many
    monkeypatch.setattr(target, "forward_many", lambda calls: last.__setitem__(0, (
        len(calls), sum(c[1].shape[-1] for c in calls), any(c[5] for c in calls))) or forward_many(calls))
    monkeypatch.setattr(RateChoice, "choose", lambda self: True)
    monkeypatch.setattr(CostAwarePolicy, "may_pay", lambda self: asked.append(self.batch) or False)
    monkeypatch.setattr(CostAwarePolicy, "chains_pay", lambda self, orders, available: False)
    learn = BatchWorker._learn_rate
    monkeypatch.setattr(BatchWorker, "_learn_rate", lambda self, n, d, tokens, s, prefill=False: learned.append(
        (d, last[0])) or learn(self, n, d, tokens, s, prefill))
    with LiveServer(make_service(target, method="ddspec", head="random:1", max_tokens=40, batch=4)) as url:
        concurrent_requests(url, [40] * 4)
    assert learned and not any(drafted for drafted, _ in learned)
    assert all(rows == n for _, (n, rows, prefill) in learned if not prefill)
    assert any(batch[0] > 0 for batch in asked)  # asked at the batch's prices


def test_a_worker_keeps_what_lives_as_long_as_it_out_of_the_collectors_full_passes():
    """What is alive when a worker starts (the model, the drafters) is frozen out of the cycle
    collector's passes while it runs, and handed back when it stops."""
    import gc

    from ddspec.server.worker import EngineWorker

    worker = EngineWorker(None, lambda method: None, "vanilla")
    before = gc.get_freeze_count()
    worker.start()
    try:
        assert gc.get_freeze_count() > before
    finally:
        worker.stop()
    assert gc.get_freeze_count() == 0 and not worker.alive


def test_the_outbox_wakes_each_loop_once_per_flush_and_keeps_each_jobs_order():
    """A batching worker's step emits an event per sequence: they reach their handlers' loop in one
    call, each job's events in the order sent, and nothing is delivered before the flush."""
    import asyncio

    from ddspec.server.worker import Job, Outbox

    loop = asyncio.new_event_loop()
    calls = []
    soon = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: calls.append(a) or soon(*a)
    try:
        outbox = Outbox()
        jobs = [Job([1], None, SamplingConfig(), "vanilla", False, False, loop, outbox=outbox) for _ in range(3)]
        for i in range(4):
            for j, job in enumerate(jobs):
                job.send("chunk", (j, i))
        jobs[1].send("done", None)
        loop.run_until_complete(asyncio.sleep(0))
        assert calls == [] and all(job.events.empty() for job in jobs)
        outbox.flush()
        outbox.flush()  # nothing left: no second wake-up
        loop.run_until_complete(asyncio.sleep(0))
        assert len(calls) == 1
        got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
        assert got[0] == [("chunk", (0, i)) for i in range(4)]
        assert got[1] == [("chunk", (1, i)) for i in range(4)] + [("done", None)]
        loop.close()
        outbox.put(jobs[0], ("chunk", None))
        outbox.flush()  # a closed loop: its events are dropped, no error
    finally:
        if not loop.is_closed():
            loop.close()


@needs_kernels
def test_drafting_held_back_in_stretches_keeps_every_token(tiny_targets):
    """The batch worker holds a cost-aware slot's drafting back for some steps (root-only steps, no
    lookup search) and allows it in others: the head catches up over the held-back steps' rows and
    the lookup over their tokens, and the tokens are plain decoding's."""
    from ddspec.draft.lookup import LookupDrafter
    from test_spec_engine import plain

    model = tiny_targets[("llama", "native")]
    prompt, n = [40, 41, 42] * 10 + [5, 17], 60
    want = plain(model, prompt, n).token_ids
    target = model.session()
    drafter = eagle(target, "ddspec")
    drafter.lookup = LookupDrafter(min_ngram=1, max_position=model.info.max_position)
    policy = drafter.cost_policy
    steps = Engine(target, drafter).steps(prompt, StopConfig(max_new_tokens=n, stop_on_eos=False))
    out, value, rows = [], None, []
    while True:
        held = (len(rows) // 4) % 2 == 0  # four steps held back, four allowed, ...
        policy.plain_only = held
        try:
            item = steps.send(value) if value is not None else next(steps)
        except StopIteration:
            break
        value = None
        if isinstance(item, Chunk):
            out += item.token_ids
            continue
        if item.last_logits:  # the prompt's prefill
            rows.append(None)
        else:
            rows.append((held, item.tokens.numel()))
        value = model.forward_many([(target, item.tokens, item.positions, item.mask, item.hidden_layers,
                                     item.last_logits)])[0]
    assert out == want
    steps_run = [r for r in rows if r is not None]
    assert all(size == 1 for held, size in steps_run if held)
    # it drafted after held-back stretches (each drafted step checks that the head caught up to the target)
    assert any(size > 1 for held, size in steps_run if not held)
    assert drafter.lookup.tokens[:len(prompt) + n] == prompt + want


@needs_kernels
def test_a_request_takes_the_free_slot_that_holds_its_prefix(tiny_dirs):
    """Two requests run side by side (the first into slot 0, the second into slot 1); then the
    second's follow-up (its prompt, its answer, more) arrives with every slot free: it takes slot 1,
    whose caches keep its history, not the first free slot, and prefills only what is new; its
    tokens are those of the same follow-up decoded from scratch. A prompt no slot holds any of goes
    to the slot used least recently."""
    import asyncio

    from ddspec.models.loading import load_target
    from ddspec.server.batch import BatchWorker
    from ddspec.server.worker import Job

    target = load_target(str(tiny_dirs["llama"]), impl="native")
    worker = BatchWorker(target, lambda method, session: None, "vanilla", slots=3)
    worker.start()
    loop = asyncio.new_event_loop()
    stop = StopConfig(max_new_tokens=12, stop_on_eos=False)

    def run(prompts: list[list[int]], reuse: bool = True) -> list[tuple[list[int], object]]:
        jobs = [Job(list(p), stop, SamplingConfig(), "vanilla", reuse, False, loop) for p in prompts]
        for job in jobs:
            worker.submit(job)

        async def collect(job):
            ids = []
            while True:
                kind, payload = await job.events.get()
                if kind == "chunk":
                    ids += payload.token_ids
                elif kind == "done":
                    return ids, payload
                else:
                    raise AssertionError(payload)

        async def every():
            return await asyncio.gather(*(collect(j) for j in jobs))

        return loop.run_until_complete(every())

    try:
        first, second = [5, 6, 7, 8] * 6, [9, 10, 11] * 6
        (_, _), (answer, _) = run([first, second])
        assert [s.engine._held is not None for s in worker.slots] == [True, True, False]
        follow = second + answer + [12, 13, 14]
        (ids, stats), = run([follow])
        assert stats.reused_tokens >= len(second) + len(answer) - 1  # slot 1's history, kept
        (alone, cold), = run([follow], reuse=False)
        assert cold.reused_tokens == 0 and ids == alone
        run([[20, 21, 22] * 4])  # no slot holds any of it: the one used least recently (slot 0) takes it
        assert worker.slots[0].engine._held[:12] == [20, 21, 22] * 4
    finally:
        worker.stop()
        loop.close()


@needs_kernels
def test_slots_share_the_heads_planned_weights_and_keep_their_own_state(tiny_targets, monkeypatch):
    """Drafters of one head on one model's sessions, built with one ``shared`` dict (a server's slots),
    hold the same kernel-planned head and draft lm_head (built once) and their own caches; decoded
    together their tokens are each one's own. Another head, or another DDSPEC_DRAFT_WEIGHTS, gets
    its own copies."""
    from ddspec.config import TreeConfig
    from ddspec.draft.checkpoint import random_head
    from ddspec.draft.eagle import EagleDrafter
    from ddspec.methods import tree_config

    model = tiny_targets[("llama", "native")]
    head = random_head(model.hf_config, seed=0).eval().requires_grad_(False)
    shared: dict = {}
    sessions = [model.session() for _ in range(3)]
    drafters = [make_drafter(m, s, head, TreeConfig(), shared=shared)
                for m, s in zip(("eagle2", "ddspec", "eagle2"), sessions)]
    first = drafters[0]
    assert all(d.packed is first.packed and d.lm_head is first.lm_head for d in drafters[1:])
    prompts = [[5, 17, 33, 8, 90], [40, 41, 42] * 20, [7] * 9]
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    solo = [Engine(model, make_drafter(m, model, head, TreeConfig())).generate(p, stop).token_ids
            for m, p in zip(("eagle2", "ddspec", "eagle2"), prompts)]
    runs = [(Engine(s, d), p, stop, join) for s, d, p, join in zip(sessions, drafters, prompts, (0, 0, 3))]
    assert drive(model, runs) == solo
    assert len({id(d.cache) for d in drafters}) == 3
    other = random_head(model.hf_config, seed=1).eval().requires_grad_(False)
    again = EagleDrafter(other, model, tree_config("eagle2", TreeConfig()), shared=shared)
    assert again.packed is not first.packed
    monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", "exact")
    exact = EagleDrafter(head, model, tree_config("eagle2", TreeConfig()), shared=shared)
    assert exact.packed is not first.packed and exact.draft_weights == "exact"

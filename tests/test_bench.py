"""`ddspec bench`: records, report arithmetic, losslessness check, prompt files, resume, plots."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ddspec.bench import report
from ddspec.bench.prompts import Prompt, builtin_prompts, load_prompt_file, load_prompts
from ddspec.bench.runner import (Bench, Generation, RecordLog, make_record, method_names, parse_methods,
                                 read_records)
from ddspec.cli import main
from ddspec.errors import DdspecError

RECORD_FIELDS = ("source", "question_id", "category", "turn", "method", "prompt_tokens", "new_tokens",
                 "wall_time", "wall_times", "finish_reason", "decoding_steps", "accept_lengths", "draft_ms",
                 "verify_ms", "tree_sizes", "output_ids")
TINY_METHODS = ("vanilla", "hf", "chain", "eagle2", "ddd")


def rec(method: str, qid: int = 1, tokens: int = 10, wall: float = 1.0, ids=None, turn: int = 1,
        category: str = "math", accept=(), source: str = "set") -> dict:
    """A hand-built record."""
    steps = len(accept) or None
    return {"source": source, "question_id": qid, "category": category, "turn": turn, "method": method,
            "new_tokens": tokens, "wall_time": wall, "decoding_steps": steps, "accept_lengths": list(accept),
            "draft_ms": 2.0 if steps else None, "verify_ms": 8.0 if steps else None,
            "tree_sizes": [5] * len(accept), "output_ids": list(range(tokens)) if ids is None else ids}


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# -- report arithmetic on hand-built records -------------------------------------------------
def test_speedup_is_a_ratio_of_totals_against_vanilla_in_the_same_run():
    records = [rec("vanilla", wall=1.0), rec("chain", wall=0.5, accept=[3, 3, 3, 1])]
    assert report.speedup(records[1:], records[:1]) == pytest.approx(2.0)
    # totals, not a mean of ratios: 20 tokens in 2 s vs 20 tokens in 1.25 s
    records = [rec("vanilla", 1, wall=1.0), rec("vanilla", 2, wall=1.0),
               rec("chain", 1, wall=0.25), rec("chain", 2, wall=1.0)]
    assert report.speedup(records[2:], records[:2]) == pytest.approx(2.0 / 1.25)
    summary = report.summarize([rec("vanilla", wall=1.0), rec("chain", wall=0.5, accept=[3, 3, 3, 1])], greedy=True)
    assert summary["overall"]["chain"]["speedup"] == pytest.approx(2.0)
    assert summary["overall"]["chain"]["tokens_per_s"] == pytest.approx(20.0)
    md = report.render_markdown(summary, {"command": "ddspec bench"})
    chain_row = next(line for line in md.splitlines() if line.startswith("| chain |"))
    assert "2.00x" in chain_row and "20.0" in chain_row and "2.50" in chain_row  # τ = (3+3+3+1)/4


def test_speedup_uses_only_prompts_both_methods_finished():
    records = [rec("vanilla", 1, wall=1.0), rec("vanilla", 2, wall=9.0), rec("chain", 1, wall=0.5)]
    assert report.speedup(records[2:], records[:2]) == pytest.approx(2.0)


def test_tau_histogram_and_step_means():
    records = [rec("eagle2", 1, accept=[1, 3, 3]), rec("eagle2", 2, accept=[2])]
    assert report.tau(records) == pytest.approx(9 / 4)
    assert report.tau_histogram(records) == {1: 1, 2: 1, 3: 2}
    assert report.per_step_means(records) == {"tree_size": 5.0, "draft_ms": 2.0, "verify_ms": 8.0}
    assert report.tau([rec("hf")]) is None
    # accepted 0, 2, 2, 1: depth 1 reached by 3 of 4 steps, depth 2 by 2 of those 3
    assert report.depth_acceptance(records) == pytest.approx([3 / 4, 2 / 3])
    assert report.depth_acceptance([rec("hf")]) == []
    split = report.time_split([rec("eagle2", tokens=10, wall=0.1, accept=[1, 3, 3])])
    assert split["draft"] == pytest.approx(0.6) and split["verify"] == pytest.approx(2.4)
    assert split["other"] == pytest.approx(10.0 - 3.0)


def test_losslessness_column_detects_a_planted_difference():
    records = [rec(m, q) for m in ("vanilla", "eagle2") for q in (1, 2, 3)]
    assert report.losslessness(records[3:], records[:3]) == (3, 3)
    records[4]["output_ids"] = records[4]["output_ids"][:5] + [99] + records[4]["output_ids"][6:]
    summary = report.summarize(records, greedy=True)
    assert summary["overall"]["eagle2"]["lossless"] == {"equal": 2, "compared": 3}
    md = report.render_markdown(summary, {"command": "x"})
    assert "| 2/3 |" in next(line for line in md.splitlines() if line.startswith("| eagle2 |"))
    sampled = report.render_markdown(report.summarize(records, greedy=False), {"command": "x"})
    assert "n/a (sampling)" in sampled


def test_summary_groups_by_file_and_category_and_notes_interruption():
    records = [rec(m, q, category=c, source=s) for m in ("vanilla", "ddd")
               for q, c, s in ((1, "math", "gsm8k"), (2, "writing", "mt_bench"))]
    summary = report.summarize(records, greedy=True)
    assert set(summary["by_source"]) == {"gsm8k", "mt_bench"}
    assert set(summary["by_category"]) == {"math", "writing"}
    md = report.render_markdown(summary, {"command": "x"}, interrupted="stopped by the user")
    assert "Interrupted run" in md and "## gsm8k" in md and "### writing" in md


# -- prompts and argument errors -------------------------------------------------------------
def test_prompt_files_are_read_with_limit_and_both_id_keys(tmp_path):
    path = write_jsonl(tmp_path / "set.jsonl", [{"question_id": 7, "category": "math", "turns": ["a", "b"]}, "",
                                               {"id": "x", "turns": ["c"]}, {"id": "y", "turns": ["d"]}])
    prompts = load_prompt_file(path, limit=2)
    assert prompts == [Prompt("set", 7, "math", ("a", "b")), Prompt("set", "x", "uncategorized", ("c",))]
    builtin = builtin_prompts()
    assert len(builtin) >= 24 and {p.category for p in builtin[:8]} == {
        "writing", "reasoning", "math", "coding", "extraction", "roleplay", "stem", "humanities"}
    assert load_prompts(None, 3) == builtin[:3]


@pytest.mark.parametrize("bad, needle", [
    ('{"question_id": 2, "turns": ["ok"]', "line 2"),
    ('{"question_id": 2, "turns": []}', "line 2"),
    ('{"question_id": 2}', "'turns'"),
    ('{"turns": ["no id"]}', "question_id"),
    ('{"question_id": 1, "turns": ["same id"]}', "already used on line 1"),
])
def test_malformed_prompt_file_names_the_file_and_line(tmp_path, bad, needle):
    path = write_jsonl(tmp_path / "broken.jsonl", [{"question_id": 1, "turns": ["fine"]}, bad])
    with pytest.raises(DdspecError, match="broken.jsonl, line 2") as e:
        load_prompt_file(path)
    assert needle in str(e.value)


def test_cli_reports_bad_prompt_files_and_methods_without_traceback(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "turns": ["hi"]}, "{not json"])
    assert main(["bench", "--prompts", path, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "p.jsonl, line 2" in err and "Traceback" not in err
    assert main(["bench", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["bench", "--methods", "vanilla,turbo"]) == 2
    err = capsys.readouterr().err
    assert "turbo" in err and ", ".join(method_names()) in err
    assert {"vanilla", "hf", "hf-lookup", "chain", "eagle", "eagle2", "ddd"} <= set(method_names())
    with pytest.raises(SystemExit) as exit_:  # argparse: --method is not a bench flag (no abbreviations)
        main(["bench", "--method", "ddd"])
    assert exit_.value.code == 2 and "--method" in capsys.readouterr().err
    with pytest.raises(DdspecError, match="empty"):
        parse_methods(" , ")
    assert not (tmp_path / "o").exists()


# -- the runner with fake arms (no model) ----------------------------------------------------
class FakeArm:
    """Answers every prompt with ``answer``; remembers the prompts it saw; fails on request."""

    def __init__(self, tokenizer, answer: str, fail_on: int | None = None, error=RuntimeError) -> None:
        self.ids, self.prompts, self.fail_on, self.error = tokenizer.encode(answer), [], fail_on, error
        self.calls = 0

    def generate(self, prompt_ids, max_new_tokens):
        self.calls += 1
        if self.fail_on is not None and self.calls >= self.fail_on:
            raise self.error("planted failure")
        self.prompts.append(prompt_ids)
        return Generation(self.ids[:max_new_tokens], 0.01, "length", None)


@pytest.fixture(scope="module")
def char_tokenizer():
    from ddspec.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


PROMPTS = [Prompt("set", 1, "writing", ("first question", "second question")), Prompt("set", 2, "math", ("sum?",)),
           Prompt("set", 3, "math", ("more?",))]


def test_multi_turn_history_holds_each_methods_own_answer(tmp_path, char_tokenizer):
    arms = {"a": FakeArm(char_tokenizer, "AAAA"), "b": FakeArm(char_tokenizer, "BBBB")}
    log = RecordLog(tmp_path, {}, resume=False)
    outcome = Bench(arms, char_tokenizer, log, max_new_tokens=8, repeats=2).run(PROMPTS[:1])
    log.close()
    assert outcome.note is None
    assert [(r["turn"], r["method"]) for r in log.records] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    second = {m: char_tokenizer.decode(arm.prompts[-1]) for m, arm in arms.items()}  # after warm-up + 2 + 2
    assert "first question" in second["a"] and "AAAA" in second["a"] and "BBBB" not in second["a"]
    assert "BBBB" in second["b"] and "AAAA" not in second["b"] and "second question" in second["b"]
    assert all(len(arm.prompts) == 1 + 2 * 2 for arm in arms.values())  # warm-up, 2 turns x 2 repeats
    assert all(len(r["wall_times"]) == 2 for r in log.records)


def test_no_arm_always_follows_the_same_one():
    """Over a run's rounds each arm follows each other arm (the caches an arm leaves are paid for by
    the next one); the order of a round is the same in every run."""
    from ddspec.bench.runner import arm_order

    arms = ["vanilla", "ddspec", "lookup", "eagle2", "llama.cpp"]
    rounds = [arm_order(arms, r) for r in range(60)]
    assert all(sorted(order) == sorted(arms) for order in rounds)
    assert rounds == [arm_order(arms, r) for r in range(60)]
    follows = {(order[i - 1] if i else prev[-1], order[i]) for prev, order in zip(rounds, rounds[1:]) for i in range(len(arms))}
    assert all((a, b) in follows for a in arms for b in arms if a != b)


def test_crash_keeps_finished_records_and_resume_completes_without_duplicates(tmp_path, char_tokenizer):
    arms = {"a": FakeArm(char_tokenizer, "A"), "b": FakeArm(char_tokenizer, "B", fail_on=5)}
    log = RecordLog(tmp_path, {}, resume=False)
    outcome = Bench(arms, char_tokenizer, log, 4, 1).run(PROMPTS)  # b: warm-up, 1/t1, 1/t2, 2, then fails
    log.close()
    assert isinstance(outcome.error, RuntimeError) and "planted failure" in outcome.note
    assert "b on set/3 turn 1" in outcome.note
    on_disk = read_records(tmp_path / "records.jsonl")
    assert len(on_disk) == 6 and on_disk == log.records
    arms = {"a": FakeArm(char_tokenizer, "A"), "b": FakeArm(char_tokenizer, "B")}
    log = RecordLog(tmp_path, {}, resume=True)
    assert Bench(arms, char_tokenizer, log, 4, 1).run(PROMPTS).note is None
    log.close()
    ids = [(r["question_id"], r["turn"], r["method"]) for r in read_records(tmp_path / "records.jsonl")]
    assert len(ids) == len(set(ids)) == 8
    assert len(arms["a"].prompts) == 1 + 1 and len(arms["b"].prompts) == 1 + 1  # warm-up + set/3 only


def test_ctrl_c_is_an_interruption_and_a_half_written_line_is_dropped(tmp_path, char_tokenizer):
    arms = {"a": FakeArm(char_tokenizer, "A", fail_on=4, error=KeyboardInterrupt)}
    log = RecordLog(tmp_path, {}, resume=False)
    outcome = Bench(arms, char_tokenizer, log, 4, 1).run(PROMPTS)
    log.close()
    assert outcome.interrupted and outcome.error is None and "Ctrl-C" in outcome.note
    path = tmp_path / "records.jsonl"
    with path.open("a") as f:
        f.write('{"source": "set", "question_id": 2, "tu')  # killed while writing
    assert len(read_records(path)) == 2
    assert path.read_text().endswith("}\n")


def test_make_record_takes_the_median_repeat():
    from ddspec.engine import StepStats

    steps = [StepStats(2, 7, 1.0, 3.0), StepStats(0, 7, 3.0, 5.0)]
    runs = [Generation([1, 2, 3, 4], 0.3, "length", steps), Generation([1, 2, 3, 4], 0.1, "length", steps[:1]),
            Generation([1, 2, 3, 4], 0.2, "length", steps)]
    r = make_record(PROMPTS[1], 1, "chain", [5, 6], runs)
    assert set(RECORD_FIELDS) <= set(r)
    assert r["wall_time"] == 0.2 and r["wall_times"] == [0.3, 0.1, 0.2]
    assert r["accept_lengths"] == [3, 1] and r["tree_sizes"] == [7, 7] and r["decoding_steps"] == 2
    assert r["draft_ms"] == 2.0 and r["verify_ms"] == 4.0 and r["prompt_tokens"] == 2 and r["new_tokens"] == 4


# -- end to end on a tiny model --------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_prompts(tmp_path_factory) -> str:
    rows = [{"question_id": 1, "category": "writing", "turns": ["Tell a story.", "Make it shorter."]},
            {"question_id": 2, "category": "math", "turns": ["What is 2+2?"]},
            {"question_id": 3, "category": "math", "turns": ["What is 3+3?"]}]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "tiny_set.jsonl", rows)


@pytest.fixture(scope="module")
def one_thread():
    """The runs below use --threads 1 (a shared 2-core machine stalls oversubscribed OpenMP threads)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_run(tiny_dirs, tiny_prompts, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("bench") / "run"
    args = ["bench", "--model", str(tiny_dirs["llama"]), "--head", "random", "--prompts", tiny_prompts,
            "--methods", ",".join(TINY_METHODS), "--max-new-tokens", "8", "--repeats", "2", "--limit", "2",
            "--out", str(out), "--threads", "1"]
    assert main(args) == 0
    return out, args


def test_tiny_run_writes_well_formed_records_summary_and_plots(tiny_run):
    out, _ = tiny_run
    records = read_records(out / "records.jsonl")
    assert len(records) == (2 + 1) * len(TINY_METHODS)  # prompt 1 has two turns
    keys = {(r["question_id"], r["turn"], r["method"]) for r in records}
    assert len(keys) == len(records)
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        assert r["source"] == "tiny_set" and isinstance(r["output_ids"], list)
        assert all(isinstance(t, int) for t in r["output_ids"]) and 1 <= r["new_tokens"] == len(r["output_ids"]) <= 8
        assert len(r["wall_times"]) == 2 and r["wall_time"] > 0
        if r["method"] == "hf":
            assert r["decoding_steps"] is None and r["accept_lengths"] == [] and r["draft_ms"] is None
        else:
            assert r["decoding_steps"] == len(r["accept_lengths"]) == len(r["tree_sizes"])
            assert sum(r["accept_lengths"]) + 1 >= r["new_tokens"]  # the prefill chose the first token
    turn2 = {r["method"]: r for r in records if r["turn"] == 2}
    turn1 = {r["method"]: r for r in records if r["turn"] == 1 and r["question_id"] == 1}
    assert all(turn2[m]["prompt_tokens"] > turn1[m]["prompt_tokens"] + turn1[m]["new_tokens"] for m in TINY_METHODS)
    summary = json.loads((out / "summary.json").read_text())
    overall = summary["overall"]
    assert list(overall) == list(TINY_METHODS) and overall["vanilla"]["speedup"] == pytest.approx(1.0)
    for m in ("chain", "eagle2", "ddd"):  # greedy fp32: every method reproduces plain decoding
        assert overall[m]["lossless"] == {"equal": 3, "compared": 3}
        assert overall[m]["tau"] >= 1.0 and overall[m]["speedup"] > 0
    assert summary["meta"]["torch threads"] == 1 and summary["interrupted"] is None
    md = (out / "summary.md").read_text()
    assert "--threads 1" in md and "cores" in md and "| ddd |" in md and "3/3" in md
    for name in ("speedup_by_category.png", "tau_histogram.png", "time_split.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_tiny_run_refuses_to_overwrite_and_resumes_with_more_prompts(tiny_run, capsys):
    out, args = tiny_run
    assert main(args) == 2
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume", "--max-new-tokens", "9"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
    before = read_records(out / "records.jsonl")
    assert main([*args, "--resume", "--limit", "3"]) == 0
    after = read_records(out / "records.jsonl")
    assert after[: len(before)] == before and len(after) == len(before) + len(TINY_METHODS)
    assert len({(r["question_id"], r["turn"], r["method"]) for r in after}) == len(after)


def test_interrupted_cli_run_still_writes_the_summary(tiny_dirs, tiny_prompts, tmp_path, monkeypatch, capsys,
                                                     one_thread):
    from ddspec.bench import runner

    calls = {"n": 0}
    real = runner.EngineArm.generate

    def flaky(self, prompt_ids, max_new_tokens):
        calls["n"] += 1
        if calls["n"] > 2:  # warm-up, then the first prompt's turn 1; Ctrl-C in its turn 2
            raise KeyboardInterrupt
        return real(self, prompt_ids, max_new_tokens)

    monkeypatch.setattr(runner.EngineArm, "generate", flaky)
    out = tmp_path / "run"
    code = main(["bench", "--model", str(tiny_dirs["llama"]), "--prompts", tiny_prompts, "--methods", "vanilla,hf",
                 "--max-new-tokens", "4", "--out", str(out), "--threads", "1"])
    assert code == 130 and "--resume" in capsys.readouterr().err
    assert len(read_records(out / "records.jsonl")) == 2  # turn 1 of prompt 1, both methods
    assert "Interrupted run" in (out / "summary.md").read_text()
    assert json.loads((out / "summary.json").read_text())["interrupted"].startswith("stopped by the user")


def test_methods_may_carry_their_own_tree_sizes():
    from ddspec.config import TreeConfig
    from ddspec.methods import method_label, split_method, tree_config

    assert parse_methods("vanilla,eagle2@d3k4n8,ddd") == ["vanilla", "eagle2@d3k4n8", "ddd"]
    assert split_method("eagle2@d3k4n8") == ("eagle2", {"depth": 3, "top_k": 4, "total_tokens": 8})
    assert split_method("chain@d2") == ("chain", {"depth": 2})
    cfg = tree_config("eagle2@k2n5", TreeConfig(depth=4))
    assert (cfg.depth, cfg.top_k, cfg.total_tokens, cfg.shape) == (4, 2, 5, "dynamic")
    assert method_label("eagle2", tree_config("eagle2@d3k4n8")) == "eagle2@d3k4n8"
    for bad in ("eagle2@", "eagle2@x3", "eagle2@n8d3", "vanilla@d2", "hf@d2"):
        with pytest.raises(DdspecError, match="bad method|unknown method"):
            parse_methods(bad)
    with pytest.raises(DdspecError, match="depth .* >= 1"):  # sizes are checked like the flags
        parse_methods("eagle2@d0k2")
    # a last t<T>: the greedy draft temperature
    assert split_method("eagle2@t0.8") == ("eagle2", {"draft_temperature": 0.8})
    assert split_method("ddd@d3k4n8t1") == ("ddd", {"depth": 3, "top_k": 4, "total_tokens": 8, "draft_temperature": 1.0})
    assert tree_config("eagle2@t0.7").draft_temperature == 0.7 and tree_config("eagle2").draft_temperature is None
    for bad in ("eagle2@t", "eagle2@t0.8d3", "eagle2@t-1"):
        with pytest.raises(DdspecError, match="bad method"):
            parse_methods(bad)
    with pytest.raises(DdspecError, match="draft_temperature .*must be in"):
        parse_methods("eagle2@t0")


def test_max_turns_keeps_the_first_turns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "category": "c", "turns": ["a", "b"]},
                                              {"id": 2, "category": "c", "turns": ["x"]}])
    assert [p.turns for p in load_prompts([path], max_turns=1)] == [("a",), ("x",)]
    assert [p.turns for p in load_prompts([path])] == [("a", "b"), ("x",)]
    with pytest.raises(DdspecError, match="--max-turns"):
        load_prompts([path], max_turns=0)


def test_the_compute_floor_counts_the_int8_peak_loop_and_bounds_the_curve():
    """The peak loop does the arithmetic it claims (its checksum: 12 running sums of the pair sums
    2 * (1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4) per round, per thread, for vpmaddubsw, of quad sums
    4 * (...) for vpdpbusd), and the floor is N tokens' weight multiply-adds at that rate, set
    against the measured T(1)."""
    from types import SimpleNamespace

    from ddspec import native
    from ddspec.bench.target import compute_floor_lines, macs_per_token

    if not native.available():
        pytest.skip(native.unavailable_reason())
    per_lane = 2 if native.library().dd_int8_peak_step() == 0 else 4  # products summed per lane and step
    assert native.library().dd_int8_peak(100, 2) == 2 * 100 * per_lane * 30
    assert native.PEAK_ROUND == 12
    assert native.int8_peak(1, seconds=0.02) > 1e9
    w = lambda o, i: SimpleNamespace(out_features=o, in_features=i)  # noqa: E731
    target = SimpleNamespace(layers=[SimpleNamespace(weights=[w(10, 20), w(30, 40)])] * 2, lm_head_w=w(50, 60))
    assert macs_per_token(target) == 2 * (200 + 1200) + 3000
    text = " ".join(compute_floor_lines(target, {1: 0.01, 8: 0.05, 16: 0.09}, peak=5800e3))  # 1 ms per token
    assert "T(8) >= 8.0 ms" in text and "T(16) >= 16.0 ms" in text
    assert "T(8)/T(1) >= 800.00" in text and "T(16)/T(1) >= 1600.00" in text
    assert compute_floor_lines(target, {}, peak=5800e3) == [] and compute_floor_lines(target, {1: 1.0}, None) == []


def test_the_reread_floor_reads_every_byte_and_bounds_the_one_token_forward():
    """The read loop sums every 32-bit word of its buffer, in any number of threads (so no read is
    skipped), and the floor is the bytes over that rate, set against T(1) and, with the compute
    floor, the T(8)/T(1) of an implementation at both floors."""
    from ddspec import native
    from ddspec.bench.target import reread_floor_lines

    if not native.available():
        pytest.skip(native.unavailable_reason())
    buf = torch.arange(3 * 128, dtype=torch.int32).view(torch.uint8)  # 1536 bytes: 12 blocks of 128
    for threads in (1, 2, 3):
        assert native.library().dd_read_sum(buf.data_ptr(), buf.numel(), threads) == sum(range(3 * 128))
    assert native.read_rate(1 << 20, 1, reps=2) > 1e8
    text = " ".join(reread_floor_lines(200_000_000, 100e9, {1: 4.0, 8: 8.0}, per_token_ms=0.5))  # 2 ms to read
    assert "less than 2.00 ms" in text and "at least 50%" in text
    assert "T(8)/T(1) = 2.00; measured here: 2.00" in text  # max(2, 8 x 0.5) / max(2, 0.5)
    assert "T(8)/T(1)" not in " ".join(reread_floor_lines(200_000_000, 100e9, {1: 4.0, 8: 8.0}, per_token_ms=None))
    assert reread_floor_lines(1, None, {1: 1.0}, 0.1) == [] and reread_floor_lines(1, 1e9, {}, 0.1) == []


def test_llama_cpp_trial_turns_a_crash_into_a_reason(monkeypatch, tmp_path):
    """A llama.cpp build that dies in its own kernels (0.3.36 with AMX: a segfault) skips the arm, not the bench."""
    from ddspec.bench import runner

    gguf = tmp_path / "m.gguf"
    monkeypatch.setattr(runner, "_TRIAL", "import os, signal, sys; assert sys.argv[2] == '2'; os.kill(os.getpid(), signal.SIGSEGV)")
    why = runner.llama_cpp_trial(gguf, 2)
    assert why is not None and "SIGSEGV" in why and "m.gguf" in why and "pip install" in why
    monkeypatch.setattr(runner, "_TRIAL", "import sys; sys.exit('no luck: ' + sys.argv[1])")
    why = runner.llama_cpp_trial(gguf, 2)
    assert why is not None and "no luck" in why
    monkeypatch.setattr(runner, "_TRIAL", "import sys; assert sys.argv[1].endswith('m.gguf')")
    assert runner.llama_cpp_trial(gguf, 2) is None


def test_target_bench_long_context_rows(tiny_dirs, monkeypatch):
    """`make bench`'s long-context table: per native arm its KV cache's dtype, the forwards over 1, 4
    and 8 tokens after LONG_CONTEXT cached tokens, their ratios and a prompt's prefill."""
    from ddspec.bench import target as bench_target
    from ddspec.models.loading import load_target

    monkeypatch.setattr(bench_target, "LONG_CONTEXT", 40)
    model = load_target(str(tiny_dirs["llama"]), impl="native")
    lines = bench_target.long_context_lines({"native": model})
    assert "after 40 cached tokens" in lines[0] and lines[2].startswith("| arm | KV cache | T(1)")
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    assert cells[:2] == ["native", "fp32"] and len(cells) == 8
    times, ratios = [float(c) for c in cells[2:5] + cells[7:]], [float(c.rstrip("x")) for c in cells[5:7]]
    assert all(t >= 0 for t in times) and all(r > 0 for r in ratios)  # a tiny model's times round to 0.0


def test_the_phase_profile_splits_a_forward_into_its_layers_phases(tiny_dirs):
    """``python -m ddspec.bench.phases`` runs on the profiling build of the kernels (its own process
    and build id) and prints each phase's time: none negative, the matmuls and the attention
    counted, the medians adding up to about the layers' total (medians do not add exactly, and the
    tiny model's phases take microseconds), which is part of the forward's wall time."""
    import subprocess
    import sys

    from ddspec import native

    if not native.available():
        pytest.skip("no native kernels here")
    env = dict(os.environ, DDSPEC_KERNEL="native")
    env.pop(native.PROFILE_ENV, None)
    run = subprocess.run([sys.executable, "-m", "ddspec.bench.phases", "--model", str(tiny_dirs["llama"]),
                          "--activations", "fp32", "--sizes", "3,1", "--prefix", "9", "--reps", "3"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    rows = {}
    for line in run.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 3 and cells[0] != "---" and not cells[1].startswith("N =") and not cells[1].endswith("x"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    assert "N = 1 | N = 3" in run.stdout  # the sizes in order
    for i in range(2):
        phases = [rows[name][i] for name in native.PHASES]
        assert min(phases) >= 0
        assert sum(rows[name][i] for name in ("q/k/v", "attention", "o", "gate/up", "down")) > 0
        assert 0.5 < sum(phases) / rows["**layers (sum)**"][i] < 2
        assert 0 < rows["**layers (sum)**"][i] < rows["**forward**"][i]
    # the matmuls alone: each of the layers' four streamed and in cache, and their sum
    for name in ("q/k/v", "o", "gate/up", "down", "**all"):
        for how in ("streamed", "in cache"):
            label = f"{name}, {how}**" if name.startswith("**") else f"{name}, {how}"
            assert min(rows[label]) > 0, label
    assert rows["**all, streamed**"][1] > rows["gate/up, streamed"][1]
    assert "The matmuls' arithmetic alone" in run.stdout


def test_the_phase_profile_refuses_bad_sizes(capsys):
    from ddspec.bench.phases import main as phases_main

    with pytest.raises(SystemExit):
        phases_main(["--sizes", "1,two"])
    assert "--sizes '1,two'" in capsys.readouterr().err

"""The n-gram table of the target's own answers: building, files, lookups, and losslessness."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.config import StopConfig, TreeConfig
from ddspec.draft.lookup import TABLE_ORDER, LookupDrafter
from ddspec.draft.ngram_table import NgramTable, resolve_table
from ddspec.engine import Engine
from ddspec.errors import ConfigError, DdspecError
from ddspec.methods import make_drafter, split_method, tree_config

META = {"target": "tiny", "vocab_size": 128}


def test_build_walks_the_most_frequent_branch_and_records_shares():
    seqs = [[1, 2, 3, 4, 5, 6]] * 3 + [[1, 2, 3, 9, 9]]
    table = NgramTable.build(seqs, META, orders=(3, 2), depth=3, min_count=2, min_share=0.25)
    tokens, shares = table.entries[(2, 3)]
    assert tokens == [4, 5, 6] and shares == pytest.approx([0.75, 0.75, 0.75])
    assert table.entries[(1, 2, 3)][0] == [4, 5, 6]
    assert (9, 9) not in table.entries  # seen once: below min_count
    # a branch shared by fewer than min_share of the ending's occurrences is cut
    table = NgramTable.build([[7, 8, 1], [7, 8, 2], [7, 8, 3], [7, 8, 1]], META, orders=(2,), depth=2,
                             min_count=2, min_share=0.5)
    assert table.entries[(7, 8)] == ([1], [0.5])


def test_continuation_prefers_the_longest_ending_and_cuts_at_min_share():
    entries = {(1, 2, 3): ([4, 5, 6], [0.9, 0.6, 0.2]), (2, 3): ([7], [0.8]), (3,): ([8], [0.9])}
    table = NgramTable(entries, META, min_share=0.3)
    assert table.continuation([0, 1, 2, 3]) == (3, [4, 5])  # 6's share 0.2 < 0.3
    assert table.continuation([9, 2, 3]) == (2, [7])
    assert table.continuation([5, 5, 3]) == (1, [8])
    assert table.continuation([5, 5, 5]) == (0, [])
    assert table.continuation([3]) == (1, [8])  # shorter than the longest order


def test_save_and_load_round_trip(tmp_path):
    seqs = [[1, 2, 3, 4, 5, 6, 7]] * 2 + [[10, 11, 12, 13]] * 3 + [[1, 2, 3, 40]]
    table = NgramTable.build(seqs, META, min_count=2)
    path = tmp_path / "t.safetensors"
    table.save(path)
    back = NgramTable.load(path)
    assert back.meta["vocab_size"] == 128 and back.meta["orders"] == [4, 3, 2]
    assert set(back.entries) == set(table.entries)
    for k, (tokens, shares) in table.entries.items():
        assert back.entries[k][0] == tokens
        assert back.entries[k][1] == pytest.approx(shares, abs=1 / 255)
    assert back.continuation([0, 10, 11]) == table.continuation([0, 10, 11]) == (2, [12, 13])
    big = NgramTable({(70000, 1): ([2, 70001], [0.9, 0.8])}, META)  # ids past uint16: int32 in the file
    big.save(path)
    assert NgramTable.load(path).entries == {(70000, 1): ([2, 70001], [pytest.approx(0.9, abs=1 / 255),
                                                                       pytest.approx(0.8, abs=1 / 255)])}
    # ids past 65534 may share a lookup key (16 bits per token): each ending still finds its own entry
    from ddspec.draft.ngram_table import ending_key

    assert ending_key((1, 0)) == ending_key((0, 65536))
    twins = NgramTable({(1, 0): ([5], [0.9]), (0, 65536): ([6], [0.9]), (7, 1, 0): ([8], [0.9])}, META)
    twins.save(path)
    back = NgramTable.load(path)
    assert back.continuation([9, 1, 0]) == (2, [5]) and back.continuation([9, 0, 65536]) == (2, [6])
    assert back.continuation([7, 1, 0]) == (3, [8]) and (65536, 0) not in back.entries and len(back.entries) == 3


def test_bad_files_and_vocabularies_are_refused_with_a_message(tmp_path, tiny_targets):
    with pytest.raises(DdspecError, match="no n-gram table"):
        NgramTable.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a table")
    with pytest.raises(DdspecError, match="not an n-gram table"):
        NgramTable.load(junk)
    target = tiny_targets[("llama", "native")]
    other = tmp_path / "other.safetensors"
    NgramTable.build([[1, 2, 3]] * 3, {"target": "big", "vocab_size": target.info.vocab_size + 1}).save(other)
    with pytest.raises(DdspecError, match="vocabulary"):
        resolve_table(str(other), target)
    assert resolve_table("none", target) is None
    assert resolve_table("auto", target) is None  # nothing ships for a tiny random model
    with pytest.raises(ConfigError, match="ngram_table"):
        TreeConfig(ngram_table="")


def test_lookup_asks_the_table_only_where_the_context_has_no_match():
    table = NgramTable({(7, 8): ([1, 2, 3, 4], [0.9] * 4)}, META)
    d = LookupDrafter(depth=3, table=table)
    d.reset(64)
    d.prefill(torch.tensor([5, 6, 7]), None, torch.tensor(8))
    assert d.continuation() == [1, 2, 3] and d.order == TABLE_ORDER + 2  # no earlier "6 7 8" / "7 8"
    d.tokens += [9, 7, 8]  # now "7 8" occurred before, followed by 9
    assert d.continuation() == [9, 7, 8] and d.order == 2
    assert LookupDrafter(depth=3).continuation() == []
    # a match on the last token alone comes after the table (ddspec's lookup goes down to one token)
    d = LookupDrafter(depth=3, min_ngram=1, table=table)
    d.reset(64)
    d.prefill(torch.tensor([8, 5, 5, 7]), None, torch.tensor(8))
    assert d.continuation() == [1, 2, 3] and d.order == TABLE_ORDER + 2  # not "8" -> 5 5 7
    d.tokens += [6]
    assert d.continuation() == [] and d.order == 0
    d.tokens += [5]
    assert d.continuation() == [7, 8, 6] and d.order == 1  # no table entry: the context's one-token match
    # told that no table chain would be verified (a batch's prices), the lookup keeps to the context
    d = LookupDrafter(depth=3, table=table)
    d.reset(64)
    d.prefill(torch.tensor([5, 6, 7]), None, torch.tensor(8))
    assert d.table_orders == (TABLE_ORDER + 2,) and LookupDrafter().table_orders == ()
    assert d.continuation(table=False) == [] and d.order == 0
    assert d.continuation() == [1, 2, 3]


def test_method_suffix_turns_the_table_off():
    assert split_method("lookup@g0") == ("lookup", {"ngram_table": "none"})
    assert split_method("ddspec@c0g0") == ("ddspec", {"context_vocab": 0, "ngram_table": "none"})
    assert split_method("lookup@d5g1") == ("lookup", {"depth": 5})
    assert tree_config("lookup@g0").ngram_table == "none"
    assert tree_config("lookup").ngram_table == "auto"
    with pytest.raises(ConfigError):
        split_method("lookup@g2")


@pytest.mark.parametrize("family, impl", [("llama", "native"), ("mistral", "hf")])
def test_lookup_with_a_table_is_greedy_identical_to_plain(tiny_targets, family, impl, tmp_path, monkeypatch):
    """A table made from the model's own answers to other prompts drafts often; the output stays plain decoding's."""
    target = tiny_targets[(family, impl)]
    stop = StopConfig(max_new_tokens=40, stop_on_eos=False)
    train = [[3 + i, 20 + 2 * i, 9] for i in range(12)]
    answers = [Engine(target).generate(p, stop).token_ids for p in train]
    path = tmp_path / "table.safetensors"
    NgramTable.build(answers, {"vocab_size": target.info.vocab_size}, min_count=2).save(path)
    base = TreeConfig(top_k=3, depth=3, total_tokens=8, ngram_table=str(path))
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path))
    drafted = 0
    for prompt in ([4, 22, 9], [100, 3, 64, 12, 99], [50, 51]):
        ref = Engine(target).generate(prompt, stop).token_ids
        drafter = make_drafter("lookup", target, None, base)
        assert drafter.table is not None
        res = Engine(target, drafter).generate(prompt, stop)
        assert res.token_ids == ref
        drafted += sum(s.tree_size > 1 for s in res.stats.steps)
        ddspec = make_drafter("ddspec", target, "random:1", base)
        assert ddspec.lookup.table is not None
        assert Engine(target, ddspec).generate(prompt, stop).token_ids == ref
    assert drafted > 0


def test_ddspec_learns_table_chains_apart_from_context_ones(tiny_targets, monkeypatch):
    """The cost-aware method's plain steps verify table chains; their acceptance is learned under
    their own orders (TABLE_ORDER + n), so a weak table does not spoil the context's matches."""
    from test_spec_engine import eagle

    target = tiny_targets[("llama", "native")]
    stop = StopConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = [100, 3, 64, 12, 99]
    ref = Engine(target).generate(prompt, stop).token_ids
    seq = prompt + ref
    table = NgramTable.build([seq, seq], {"vocab_size": target.info.vocab_size}, min_count=2)
    drafter = eagle(target, "ddspec")
    drafter.lookup = LookupDrafter(min_ngram=1, max_position=target.info.max_position, table=table)
    monkeypatch.setattr(drafter.cost_policy, "draft_now", lambda chain=None: False)
    res = Engine(target, drafter).generate(prompt, stop)
    assert res.token_ids == ref
    stats = drafter.cost_policy._chain_stats
    assert any(order > TABLE_ORDER for order in stats)
    assert sum(s.accepted for s in res.stats.steps) > 0


def test_ngrams_command_answers_resumes_and_builds(tmp_path, tiny_dirs):
    from ddspec.cli import main
    from ddspec.models.loading import load_target

    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": f"s{i % 2}:{i}", "source": f"s{i % 2}", "turns": [f"question {i} about {i * 7}"]}) + "\n")
    excl = tmp_path / "x.jsonl"
    excl.write_text(json.dumps({"id": "s0:0"}) + "\n")
    out = tmp_path / "run"
    args = ["ngrams", "--out", str(out), "--prompts", str(prompts), "--exclude", str(excl), "--per-source", "2",
            "--max-new-tokens", "12", "--model", str(tiny_dirs["llama"])]
    assert main(args) == 0
    answers = [json.loads(line) for line in open(out / "answers.jsonl")]
    assert len(answers) == 4 and "s0:0" not in {a["id"] for a in answers}
    assert all(len(a["output_ids"]) == 12 for a in answers)
    table = NgramTable.load(out / "ngrams.safetensors")
    assert table.meta["answers"] == 4
    assert main(args) == 0  # a rerun resumes: nothing more to answer
    assert len(open(out / "answers.jsonl").readlines()) == 4
    assert main(args + ["--max-prompts", "3"]) == 0  # a table of the sample's first 3 answers
    assert NgramTable.load(out / "ngrams.safetensors").meta["answers"] == 3
    with open(out / "answers.jsonl") as f:  # the answers are plain greedy decoding's
        first = json.loads(f.readline())
    target = load_target(str(tiny_dirs["llama"]))
    assert first["output_ids"] == Engine(target).generate(first["prompt_ids"], StopConfig(max_new_tokens=12)).token_ids
    # a run killed while writing leaves a cut line: it is dropped, and a rerun answers that prompt again
    text = (out / "answers.jsonl").read_text()
    (out / "answers.jsonl").write_text(text[:-20])
    assert main(args + ["--build-only"]) == 0
    assert len(open(out / "answers.jsonl").readlines()) == 3
    assert NgramTable.load(out / "ngrams.safetensors").meta["answers"] == 3
    assert main(args) == 0
    assert len(open(out / "answers.jsonl").readlines()) == 4
    assert main(args + ["--cap", "bad"]) == 2


def test_ngrams_command_samples_in_its_own_folder_and_joins_other_answers(tmp_path, tiny_dirs):
    """--temperature samples the answers (seeded: the same text twice), each marked with it; a folder
    of greedy answers refuses a sampled run (and the reverse), and --also adds another run's answers."""
    from ddspec.cli import main

    prompts = tmp_path / "p.jsonl"
    with open(prompts, "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"s:{i}", "source": "s", "turns": [f"question {i} about {i * 7}"]}) + "\n")
    base = ["ngrams", "--prompts", str(prompts), "--per-source", "3", "--max-new-tokens", "10",
            "--model", str(tiny_dirs["llama"])]
    greedy, hot, again = tmp_path / "greedy", tmp_path / "hot", tmp_path / "again"
    assert main(base + ["--out", str(greedy)]) == 0
    sampled = ["--temperature", "1.5", "--sample-seed", "3"]
    assert main(base + ["--out", str(hot), *sampled, "--also", str(greedy / "answers.jsonl")]) == 0
    assert main(base + ["--out", str(again), *sampled]) == 0

    def read(folder):
        return [json.loads(line) for line in open(folder / "answers.jsonl")]

    hot_rows, greedy_rows = read(hot), read(greedy)
    assert all(r["temperature"] == 1.5 and r["seed"] == 3 for r in hot_rows)
    assert [r["output_ids"] for r in hot_rows] == [r["output_ids"] for r in read(again)]  # seeded
    assert [r["output_ids"] for r in hot_rows] != [r["output_ids"] for r in greedy_rows]  # sampled, not greedy
    meta = NgramTable.load(hot / "ngrams.safetensors").meta
    assert meta["answers"] == 6 and meta["also_answers"] == 3 and meta["temperature"] == 1.5
    assert main(base + ["--out", str(hot)]) == 2  # greedy answers into a folder of sampled ones
    assert main(base + ["--out", str(greedy), *sampled]) == 2  # and the reverse
    assert main(base + ["--out", str(hot), *sampled, "--also", str(hot / "answers.jsonl")]) == 2  # its own file
    assert main(base + ["--out", str(tmp_path / "bad"), "--temperature", "-1"]) == 2


def test_a_table_without_endings_saves_and_loads(tmp_path):
    """Answers too few or too varied for any ending to repeat give an empty table, not a crash."""
    table = NgramTable.build([[1, 2, 3], [4, 5, 6]], {"note": "empty"})
    assert len(table) == 0
    table.save(tmp_path / "t.safetensors")
    loaded = NgramTable.load(tmp_path / "t.safetensors")
    assert len(loaded) == 0 and loaded.continuation([1, 2, 3]) == (0, [])

"""The prompt sets shipped inside the package: named on the command line, readable from a clone
or an installed wheel with nothing beside it."""

from __future__ import annotations

import pytest

from ddspec.bench.prompts import load_prompts
from ddspec.datasets import EVAL_SETS, TRAIN_PROMPTS, eval_set, resolve_prompt_sources
from ddspec.errors import DdspecError
from ddspec.train.data import read_prompts


def test_each_evaluation_set_ships_with_80_prompts():
    for name in EVAL_SETS:
        prompts = load_prompts([name])
        assert len(prompts) == 80 and all(p.turns for p in prompts)
    assert {len(p.turns) for p in load_prompts(["mt-bench"])} == {2}


def test_sets_are_named_comma_separated_beside_files(tmp_path):
    own = tmp_path / "mine.jsonl"
    own.write_text('{"id": 1, "turns": ["hi"]}\n')
    paths = resolve_prompt_sources(["mt-bench,gsm8k", str(own), "mt_bench"])
    assert paths == [str(eval_set("mt-bench")), str(eval_set("gsm8k")), str(own), str(eval_set("mt-bench"))]
    prompts = load_prompts(["humaneval,gsm8k"], limit=2)
    assert [p.source for p in prompts] == ["humaneval", "humaneval", "gsm8k", "gsm8k"]


@pytest.mark.parametrize("spec", ["mtbench", "mt-bench,nope", "missing.jsonl"])
def test_an_unknown_set_or_missing_file_names_the_choices(spec):
    with pytest.raises(DdspecError, match="mt-bench, humaneval, gsm8k"):
        resolve_prompt_sources([spec])


def test_training_prompts_ship_compressed_and_hold_no_evaluation_prompt():
    records, report = read_prompts(TRAIN_PROMPTS)
    assert len(records) == 15586 and not report.bad_lines
    evaluation = {t for name in EVAL_SETS for p in load_prompts([name]) for t in p.turns}
    assert not evaluation & {r.text for r in records}

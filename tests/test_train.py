"""`ddspec train`: the tiny end-to-end pipeline, resumption, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.cli import main
from ddspec.errors import DdspecError
from ddspec.train.data import balanced_mix, read_prompts, length_groups


def test_tiny_pipeline_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "all", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["response_tokens"] >= 600
    stages = json.loads((out / "stages.json").read_text())
    assert set(stages) == {"data", "fit", "eval", "export"} and all(s["wall_s"] > 0 for s in stages.values())
    assert "[train calibrate] skipped: no held-out sequences" in capsys.readouterr().err
    evals = json.loads((out / "eval.json").read_text())
    r = evals["head"]["tiny"]
    assert r["identical_to_plain"] == "4/4" and r["tau"] >= 1.0
    assert r["by_category"]["tiny"]["turns"] == 4 and abs(r["by_category"]["tiny"]["tau"] - r["tau"]) < 1e-9
    assert r["tau_steps"] > 0 and r["tau"] == r["tau_tokens"] / r["tau_steps"]
    assert f"tau {r['tau']:.3f} ({r['tau_tokens']} tokens in {r['tau_steps']} steps)" in (out / "eval.log").read_text()
    card = (out / "export" / "README.md").read_text()
    assert "τ" in card and "Reproduce" in card
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["ddspec"]["training"]["steps"] > 0
    # trained on the target's answers, the head predicts them better than chance
    fit = stages["fit"]
    assert fit["acc"] > 0.1

    # running a finished stage again resumes: no new shards, no new training steps
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    assert json.loads((out / "data" / "manifest.json").read_text())["sequences"] == manifest["sequences"]
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    assert "resuming from step" in capsys.readouterr().err
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == state["step"]

    # two turns per prompt: the second follows plain decoding's first answer; every turn checked
    assert main(["train", "eval", "--tiny", "--out", str(out), "--threads", "1", "--eval-turns", "2"]) == 0
    r2 = json.loads((out / "eval.json").read_text())["head"]["tiny"]
    assert (r2["prompts"], r2["turns"], r2["identical_to_plain"]) == (4, 8, "8/8")
    assert r2["tau_steps"] > r["tau_steps"] and r2["by_category"]["tiny"]["turns"] == 8
    assert "(4 prompts, 8 turns)" in (out / "eval.log").read_text()
    by_turn = r2["by_turn"]  # json keys: the turn numbers as text
    assert [(t, e["turns"]) for t, e in by_turn.items()] == [("1", 4), ("2", 4)]
    assert sum(e["steps"] for e in by_turn.values()) == r2["tau_steps"]
    assert sum(e["tokens"] for e in by_turn.values()) == r2["tau_tokens"]
    assert "tau by turn: turn 1 " in (out / "eval.log").read_text()
    assert main(["train", "eval", "--tiny", "--out", str(out), "--threads", "1", "--eval-turns", "0"]) != 0
    assert "--eval-turns 0" in capsys.readouterr().err


def test_tiny_eagle3_pipeline_end_to_end(tmp_path, capsys):
    """`--arch eagle3`: the data keep the captured states, the head trains on its own outputs, loads as an
    EAGLE-3 head, drafts losslessly, and exports in the published layout; a rerun resumes."""
    from ddspec.draft.checkpoint import load_head
    from ddspec.draft.eagle3 import Eagle3Head

    out = tmp_path / "run"
    base = ["--tiny", "--out", str(out), "--threads", "1", "--arch", "eagle3"]
    assert main(["train", "all", *base, "--ttt-passes", "2"]) == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["settings"]["capture_layers"] == [1, 1, 1]
    seq = torch.load(out / "data" / "shard-00000.pt", weights_only=True)[0]
    assert seq["states"].shape == (seq["features"].shape[0], 3 * seq["features"].shape[1])
    stages = json.loads((out / "stages.json").read_text())
    assert stages["fit"]["acc"] > 0.1 and "acc2" in stages["fit"] and "v_loss" not in stages["fit"]
    r = json.loads((out / "eval.json").read_text())["head"]["tiny"]
    assert r["identical_to_plain"] == "4/4" and r["tau"] >= 1.0
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    from ddspec.models.loading import load_target

    target = load_target(str(out / "tiny_model"), impl="native")
    head = load_head(out / "export", target.info)
    assert isinstance(head, Eagle3Head) and head.hidden_layers == (1, 1, 1)
    # the head starts from the target's own output map: its lm_head rows are the target's
    ids = head.draft_token_ids
    assert torch.allclose(head.lm_head.weight.float(), target.lm_head_weight_t()[:, ids].t().half().float())
    state = torch.load(out / "train_state.pt", weights_only=False)
    capsys.readouterr()
    assert main(["train", "fit", *base, "--ttt-passes", "2"]) == 0
    assert "resuming from step" in capsys.readouterr().err
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == state["step"]
    # side by side with another head in one eval run; a bad --against is named
    capsys.readouterr()
    assert main(["train", "eval", *base, "--against", str(out / "export")]) == 0
    both = json.loads((out / "eval.json").read_text())
    assert both["against"]["tiny"]["identical_to_plain"] == "4/4" and both["against"]["tiny"]["tau"] >= 1.0
    assert main(["train", "eval", *base, "--against", str(tmp_path / "nowhere")]) == 2
    assert "not a head folder" in capsys.readouterr().err
    # EAGLE-1/2 data has no captured states: an EAGLE-3 fit on it is refused with the fix
    plain = tmp_path / "plain"
    assert main(["train", "data", "--tiny", "--out", str(plain), "--threads", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "fit", "--tiny", "--out", str(plain), "--threads", "1", "--arch", "eagle3"]) == 2
    err = capsys.readouterr().err
    assert "--arch eagle3" in err and "Traceback" not in err
    # and data made for one kind of head is not extended for the other
    assert main(["train", "data", "--tiny", "--out", str(plain), "--threads", "1", "--arch", "eagle3"]) == 2
    assert "without layer states" in capsys.readouterr().err

    # a later run on more data starts from this head: fc, midlayer and norm carried, its own vocabulary
    import shutil

    from ddspec.train.pipeline import _warm_start_eagle3
    from ddspec.train.trainer import new_eagle3_head

    fresh = new_eagle3_head(target, torch.arange(0, 64, 2), (1, 1, 1))
    _warm_start_eagle3(fresh, str(out / "export"), target)
    carried = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    assert all(torch.equal(fresh.state_dict()[k], v.float()) for k, v in carried.items())
    assert torch.equal(fresh.lm_head.weight, target.lm_head_weight_t()[:, torch.arange(0, 64, 2)].t())
    shutil.move(out / "export", tmp_path / "earlier")  # a new fit in the same folder (same data, same target)
    (out / "train_state.pt").unlink()
    assert main(["train", "fit", "--tiny", "--out", str(plain), "--threads", "1"]) == 0  # an EAGLE-1/2 head
    capsys.readouterr()
    assert main(["train", "fit", *base, "--init-from", str(plain / "head")]) == 2
    assert "is an EAGLE-1/2 head" in capsys.readouterr().err
    assert main(["train", "fit", *base, "--init-from", str(tmp_path / "earlier")]) == 0
    assert "warm start from the weights of" in capsys.readouterr().err


def test_export_from_an_unfinished_run(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    for stage in ("data", "fit"):
        assert main(["train", stage, "--tiny", "--out", str(out), "--threads", "1"]) == 0
    shutil.rmtree(out / "head")  # as if training had been interrupted after a checkpoint
    assert main(["train", "export", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    assert "exporting the checkpoint" in capsys.readouterr().err
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["ddspec"]["training"]["partial"] is True


def test_warm_start_from_an_earlier_head(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    for stage in ("data", "fit"):
        assert main(["train", stage, "--tiny", "--out", str(out), "--threads", "1"]) == 0
    cold = torch.load(out / "train_state.pt", weights_only=False)["history"]
    shutil.move(out / "head", tmp_path / "round1")
    (out / "train_state.pt").unlink()
    capsys.readouterr()
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1",
                 "--init-from", str(tmp_path / "round1")]) == 0
    assert "warm start from" in capsys.readouterr().err
    warm = torch.load(out / "train_state.pt", weights_only=False)["history"]
    # the warm run starts where the cold one ended, not where it began
    assert warm[0]["loss"] < cold[0]["loss"]
    mean = lambda h, k: sum(x[k] for x in h) / len(h)  # noqa: E731
    assert mean(warm, "loss") < mean(cold, "loss") and mean(warm, "acc") > mean(cold, "acc")
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["ddspec"]["training"]["init_from"] == str(tmp_path / "round1")
    assert main(["train", "fit", "--tiny", "--out", str(tmp_path / "other"), "--threads", "1",
                 "--init-from", str(tmp_path / "missing")]) == 2


def test_a_head_with_a_narrower_mlp_than_its_target(tmp_path, capsys):
    """--head-ffn: the head's MLP width in its config; it trains, decodes losslessly through the
    engine, a warm start keeps it, and another width from a warm start is refused."""
    out = tmp_path / "run"
    for stage in ("data", "fit"):
        assert main(["train", stage, "--tiny", "--out", str(out), "--threads", "1", "--head-ffn", "24"]) == 0
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["intermediate_size"] == 24
    assert main(["train", "eval", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    r = json.loads((out / "eval.json").read_text())["head"]["tiny"]
    assert r["identical_to_plain"] == "4/4" and r["tau"] >= 1.0
    warm = tmp_path / "warm"
    assert main(["train", "data", "--tiny", "--out", str(warm), "--threads", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "fit", "--tiny", "--out", str(warm), "--threads", "1", "--init-from", str(out / "head"),
                 "--head-ffn", "16"]) == 2
    assert "--head-ffn 16: the --init-from head" in capsys.readouterr().err
    assert main(["train", "fit", "--tiny", "--out", str(warm), "--threads", "1", "--init-from", str(out / "head")]) == 0
    assert json.loads((warm / "head" / "config.json").read_text())["intermediate_size"] == 24


def test_keep_draft_vocab_carries_the_earlier_heads_vocabulary(tiny_targets, tmp_path):
    from ddspec.draft.checkpoint import random_head, save_head
    from ddspec.train.pipeline import _new_head

    target = tiny_targets[("llama", "native")]
    earlier = random_head(target.hf_config, seed=3)
    ids = torch.arange(0, 64, 2)  # a 32-token draft vocabulary: the even ids
    earlier.register_buffer("d2t", ids - torch.arange(32))
    save_head(earlier, tmp_path / "earlier")
    # this run's data speaks only odd ids: counting it would choose another vocabulary
    seqs = [{"input_ids": torch.arange(1, 80, 2), "prompt_len": 0}]
    kept = _new_head(target, seqs, 32, str(tmp_path / "earlier"), keep_vocab=True)
    assert torch.equal(kept.d2t, earlier.d2t)
    assert torch.equal(kept.layers[0].mlp.up_proj.weight, earlier.layers[0].mlp.up_proj.weight)
    counted = _new_head(target, seqs, 32, str(tmp_path / "earlier"))
    assert not torch.equal(counted.d2t, earlier.d2t) and bool(((counted.d2t + torch.arange(32)) % 2 == 1).any())
    with pytest.raises(DdspecError, match="--draft-vocab 16"):
        _new_head(target, seqs, 16, str(tmp_path / "earlier"), keep_vocab=True)
    with pytest.raises(DdspecError, match="pass --init-from"):
        _new_head(target, seqs, 32, None, keep_vocab=True)
    save_head(random_head(target.hf_config, seed=4), tmp_path / "full")
    with pytest.raises(DdspecError, match="full vocabulary"):
        _new_head(target, seqs, 32, str(tmp_path / "full"), keep_vocab=True)


def test_data_from_another_target_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    manifest_path = out / "data" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["target"] = "SomeOtherModel:0123456789abcdef"
    manifest_path.write_text(json.dumps(manifest))
    capsys.readouterr()
    for stage in ("data", "fit"):
        assert main(["train", stage, "--tiny", "--out", str(out), "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert "SomeOtherModel" in err and "Traceback" not in err


def test_bad_prompt_lines_are_skipped_and_counted(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "source": "s", "turns": ["hello"]}\n'
                 'not json\n'
                 '{"id": "b", "turns": []}\n'
                 '\n'
                 '{"id": "c", "source": "t", "turns": ["world"]}\n')
    records, report = read_prompts(f)
    assert [r.id for r in records] == ["a", "c"]
    assert report.bad_lines == [2, 3] and "2 skipped" in report.describe() and "lines 2, 3" in report.describe()
    with pytest.raises(DdspecError, match="not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_balanced_mix_caps_and_interleaves():
    from ddspec.train.data import PromptRecord

    recs = [PromptRecord(f"g{i}", "gsm8k_train", "q") for i in range(100)]
    recs += [PromptRecord(f"r{i}", "roleplay", "q") for i in range(10)]
    mix = balanced_mix(recs, caps={"gsm8k_train": 20})
    assert len(mix) == 30
    first_half = mix[:15]
    assert 3 <= sum(r.source == "roleplay" for r in first_half) <= 7  # interleaved, not appended


@pytest.mark.parametrize("rows,prefill_tokens,sessions", [(2, 4096, False), (4, 6, False), (2, 4096, True),
                                                             (4, 4096, True)])
def test_generated_features_match_a_full_forward(tiny_targets, monkeypatch, rows, prefill_tokens, sessions):
    from ddspec.train import generate
    from ddspec.train.generate import check_features_match, generate_batch

    target = tiny_targets[("llama", "native")]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31], [40, 41, 42, 43, 44, 45], [50, 51, 52, 53]]
    # 2 rows for 6 prompts: rows are refilled; capacity 2 * (6 + 12) slots: the cache shifts.
    # 4 rows with at most 6 padded prompt tokens per prefill: new prompts prefill in several groups.
    # sessions: each row a session of its own, the steps through forward_many (the C kernels' path)
    monkeypatch.setattr(generate, "PREFILL_TOKENS", prefill_tokens)
    results = generate_batch(target, prompts, 12, rows=rows, max_prompt=6, capture=(0, 1), sessions=sessions)
    from ddspec.config import StopConfig
    from ddspec.engine import Engine

    for p, (resp, feats, states) in zip(prompts, results):
        ref = Engine(target).generate(p, StopConfig(max_new_tokens=12)).token_ids
        assert resp == ref  # batched, left-padded greedy == single-sequence greedy
        assert check_features_match(target, feats, torch.tensor(p + resp)) < 1e-4
        # the captured inputs of layers 0 and 1 (fp16) are the full forward's, in that order
        seq = torch.tensor([p + resp])
        full = target.hidden_batch(seq, None, (0, 1))
        want = torch.cat([full[0][0], full[1][0]], dim=-1)[: len(p) + len(resp) - 1]
        assert states.dtype == torch.float16 and states.shape == want.shape
        assert torch.allclose(states.float(), want, atol=2e-3, rtol=2e-3)


def test_ttt_mask_pattern():
    from ddspec.train.trainer import ttt_mask

    assert torch.equal(ttt_mask(4, 1), torch.ones(4, 4, dtype=torch.bool).tril())
    m = ttt_mask(5, 3)  # pass 3 at index i: true entries before i - 1, pass-2 node i - 1, itself
    assert m.shape == (5, 15)
    assert m[3, :5].tolist() == [True, True, False, False, False]
    assert m[3, 5:10].tolist() == [False, False, True, False, False]
    assert m[3, 10:].tolist() == [False, False, False, True, False]
    assert m.any(dim=1).all()  # no query row without a key


@pytest.mark.parametrize("layers", [1, 2, "eagle3"])
def test_training_time_test_passes_reproduce_the_engines_draft_nodes(layers):
    """Pass k of the training-time test computes exactly what drafting computes at depth k - 1."""
    from ddspec.draft.checkpoint import random_head
    from ddspec.draft.eagle3 import Eagle3Head
    from ddspec.models.tiny import tiny_config
    from ddspec.train.trainer import ttt_passes

    if layers == "eagle3":  # features stand for fc(captured states) at committed entries, h at drafted ones
        torch.manual_seed(3)
        head = Eagle3Head({**tiny_config().to_dict(), "draft_vocab_size": 32}, (1, 1, 1)).eval()
    else:
        head = random_head(tiny_config().to_dict(), seed=3, std=0.05, layers=layers).eval()
    t, h = 12, head.hidden_size
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (t + 1,))
    feats = torch.randn(t, h)
    emb = torch.nn.Embedding(128, h)
    with torch.no_grad():
        p1, p2, p3 = ttt_passes(head, emb(tokens[1:]).unsqueeze(0), feats.unsqueeze(0), 3)
        for c in (1, 4, 9):  # committed entries 0 .. c-1 hold (f_i, x_{i+1}); the root hidden is f̂_c
            cache = head.new_cache(32)
            causal = torch.ones(c, c, dtype=torch.bool).tril().view(1, 1, c, c)
            committed = head(emb(tokens[1:c + 1]).unsqueeze(0), feats[:c].unsqueeze(0), torch.arange(c), causal, cache)[0]
            assert torch.allclose(committed[-1], p1[0, c - 1], rtol=1e-3, atol=1e-3)
            d1 = head(emb(tokens[c + 1]).view(1, 1, h), committed[-1].view(1, 1, h), torch.tensor([c]),
                      torch.ones(1, 1, 1, c + 1, dtype=torch.bool), cache)[0, 0]
            assert torch.allclose(d1, p2[0, c], rtol=1e-3, atol=1e-3)
            d2 = head(emb(tokens[c + 2]).view(1, 1, h), d1.view(1, 1, h), torch.tensor([c + 1]),
                      torch.ones(1, 1, 1, c + 2, dtype=torch.bool), cache)[0, 0]
            assert torch.allclose(d2, p3[0, c + 1], rtol=1e-3, atol=1e-3)
            assert not torch.allclose(d2, p1[0, c + 1], rtol=1e-2, atol=1e-2)  # teacher forcing differs


def test_training_time_test_and_held_out_selection(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    args = ["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--ttt-passes", "2",
            "--val-sequences", "4", "--eval-every", "5"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "best on 4 held-out sequences" in err
    cfg = json.loads((out / "head" / "config.json").read_text())
    training = cfg["ddspec"]["training"]
    assert {"acc", "acc2", "best_val"} <= set(training)
    assert training["settings"]["ttt_passes"] == 2 and 0 <= training["best_val"]["val_acc2"] <= 1
    state = torch.load(out / "train_state.pt", weights_only=False)
    # the head kept is the best held-out one (saved with the state, so a resumed run keeps it)
    vals = [h for h in state["history"] if "val_acc" in h]
    assert len(vals) >= 2 and state["best"]["score"] == max((h["val_acc"] + h["val_acc2"]) / 2 for h in vals)
    from safetensors.torch import load_file

    shipped = load_file(out / "head" / "model.safetensors")
    assert all(torch.equal(shipped[k].float(), v.float()) for k, v in state["best"]["head"].items() if k in shipped)
    assert main(["train", "export", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    card = (out / "export" / "README.md").read_text()
    assert "training-time test: 2 passes" in card and f"the head of step {state['best']['step']}" in card


def test_a_fit_does_not_resume_over_other_data(tmp_path, capsys):
    """A finished fit's state names how many sequences it trained on: after the data grows (or the
    held-out share changes) a rerun is refused with the warm start to use instead, not resumed."""
    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    fit = ["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--val-sequences", "2"]
    assert main(fit) == 0
    assert main(fit) == 0  # the same data: resumes (nothing left to do)
    capsys.readouterr()
    assert main(fit[:-1] + ["4"]) != 0
    err = capsys.readouterr().err
    assert "train_state.pt" in err and "--init-from" in err and "Traceback" not in err


def test_bad_training_options_are_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--val-sequences", "100000"]) != 0
    assert "--val-sequences 100000" in capsys.readouterr().err
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--ttt-passes", "0"]) != 0
    assert "--ttt-passes" in capsys.readouterr().err
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--p-weight", "-1"]) != 0
    assert "--p-weight" in capsys.readouterr().err


def test_prompt_loss_counts_prompt_positions_too():
    from ddspec.train.trainer import collate

    seq = {"input_ids": torch.arange(10, dtype=torch.int32), "prompt_len": 6, "features": torch.zeros(9, 4)}
    _, _, _, response_only, _ = collate([seq], [0], 640)
    _, _, _, everything, _ = collate([seq], [0], 640, prompt_loss=True)
    # step t predicts token t + 2: steps 4..7 predict response tokens 6..9
    assert response_only[0].tolist() == [False] * 4 + [True] * 4
    assert everything[0].all()


def test_eval_sets_with_counts_and_categories(tmp_path):
    from ddspec.train.evaluate import first_turn_records, parse_eval_sets, turn_records

    known = ("mt_bench", "humaneval", "gsm8k")
    assert parse_eval_sets("mt_bench:80, humaneval,gsm8k:5", 20, known) == {"mt_bench": 80, "humaneval": 20, "gsm8k": 5}
    for bad, said in (("mtbench", "unknown eval set 'mtbench'"), ("gsm8k:x", "whole number"), ("gsm8k:0", "at least 1"),
                      (" , ", "empty")):
        with pytest.raises(DdspecError, match=said):
            parse_eval_sets(bad, 20, known)
    path = tmp_path / "e.jsonl"
    path.write_text('{"category": "writing", "turns": ["a", "b"]}\n\n{"category": "math", "turns": ["c"]}\n')
    assert first_turn_records(path, 5) == [("writing", "a"), ("math", "c")]
    assert turn_records(path, 5, 2) == [("writing", ["a", "b"]), ("math", ["c"])]
    assert turn_records(path, 1, 3) == [("writing", ["a", "b"])]
    path.write_text('{"category": "writing", "turns": []}\n')
    with pytest.raises(DdspecError, match="line 1"):
        first_turn_records(path, 5)


def test_model_card_data_time_counts_every_resumed_run():
    from ddspec.train.model_card import _stage_time

    # stages.json keeps the last data run only; the manifest sums the generation of all shards
    assert _stage_time("data", {"wall_s": 600}, {"wall_s": 3600}) == \
        "60.0 min of generation over all runs (the last run: 10.0 min)"
    assert _stage_time("data", {"wall_s": 600}, {"wall_s": 600}) == "10.0 min"
    assert _stage_time("fit", {"wall_s": 120}, {"wall_s": 3600}) == "2.0 min"


def test_sampled_passes_add_new_target_written_answers(tmp_path, capsys):
    from ddspec.train.generate import check_features_match, load_shards

    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--sampled-answers", "1",
                 "--temperature", "1.0"]) == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    passes = [e.get("pass", 0) for e in manifest["shards"].values()]
    assert 0 in passes and 1 in passes and manifest["response_tokens"] >= 1200
    # every shard is reported in the stage's log (and, with no progress bar on a terminal, its output)
    err, logged = capsys.readouterr().err, (out / "data.log").read_text()
    for key, e in manifest["shards"].items():
        line = f"shard {key} ({'sampled pass 1' if e.get('pass') else 'greedy'}, prompts {e['first']}-"
        assert line in logged and line in err, line
    seqs = load_shards(out / "data")
    greedy = {s["id"]: s for s in seqs if "#" not in s["id"]}
    sampled = [s for s in seqs if s["id"].endswith("#s1")]
    assert sampled and all(s["id"][:-3] in greedy for s in sampled)
    differ = sum(not torch.equal(s["input_ids"], greedy[s["id"][:-3]]["input_ids"]) for s in sampled)
    assert differ >= len(sampled) // 2  # sampled answers are new text, not the greedy one again
    # the stored features are the target's own at those sampled tokens
    from ddspec.models.loading import load_target

    target = load_target(str(out / "tiny_model"), impl="native")
    s = sampled[0]
    assert check_features_match(target, s["features"].float(), s["input_ids"].long()) < 1e-2
    # a rerun of a sampled shard writes the same tokens (a seed per shard)
    key = max(k for k, e in manifest["shards"].items() if e.get("pass") == 1)
    before = torch.load(out / "data" / f"shard-{key}.pt", weights_only=True)
    (out / "data" / f"shard-{key}.pt").unlink()
    m = json.loads((out / "data" / "manifest.json").read_text())
    e = m["shards"].pop(key)
    m["response_tokens"] -= e["response_tokens"]
    m["sequences"] -= e["sequences"]
    (out / "data" / "manifest.json").write_text(json.dumps(m))
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--sampled-answers", "1",
                 "--temperature", "1.0"]) == 0
    after = torch.load(out / "data" / f"shard-{key}.pt", weights_only=True)
    assert [x["input_ids"].tolist() for x in after] == [x["input_ids"].tolist() for x in before]
    # bad options name themselves
    capsys.readouterr()
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--sampled-answers", "1",
                 "--temperature", "0"]) == 2
    assert "--temperature" in capsys.readouterr().err
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--sampled-answers", "1",
                 "--sample-sources", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "nosuch" in err and "tiny" in err and "Traceback" not in err


def test_sampled_passes_only_numbered_from_a_later_pass(tmp_path, capsys):
    """--no-greedy-pass --first-sampled-pass K: only sampled answers, new ones beside an earlier run's passes."""
    from ddspec.train.generate import load_shards

    runs = {}
    for name, extra in (("first", []), ("later", ["--no-greedy-pass", "--first-sampled-pass", "2"])):
        out = tmp_path / name
        assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--sampled-answers", "1",
                     "--temperature", "1.0", *extra]) == 0
        runs[name] = {s["id"]: s["input_ids"] for s in load_shards(out / "data")}
    later = runs["later"]
    assert later and all(k.endswith("#s2") for k in later)  # no greedy answers, pass 2 only
    earlier = {k[:-3]: v for k, v in runs["first"].items() if k.endswith("#s1")}
    common = [k[:-3] for k in later if k[:-3] in earlier]
    assert common and sum(not torch.equal(later[k + "#s2"], earlier[k]) for k in common) >= len(common) // 2
    capsys.readouterr()
    assert main(["train", "data", "--tiny", "--out", str(tmp_path / "x"), "--threads", "1", "--no-greedy-pass"]) == 2
    assert "--sampled-answers" in capsys.readouterr().err
    assert main(["train", "data", "--tiny", "--out", str(tmp_path / "x"), "--threads", "1", "--sampled-answers", "1",
                 "--first-sampled-pass", "0"]) == 2
    assert "--first-sampled-pass" in capsys.readouterr().err


def test_length_groups_keep_each_group_within_the_padded_budget():
    lengths = [5, 300, 12, 7, 290, 1000, 6]
    groups = length_groups(lengths, 600)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 600
    assert [lengths[i] for g in groups for i in g] == sorted(lengths)  # shortest first
    assert groups[-1] == [5]  # longer than the budget: alone
    assert length_groups([], 10) == []


def test_sampled_rows_follow_the_tempered_distribution():
    """sample_rows draws each row from softmax(logits / T): frequencies within 4 sigma of the
    probabilities (a wrong temperature, an off-by-one in the inverse CDF or rows mixed up move
    them by far more), zero-probability tokens never drawn, and a seed repeats the draw."""
    from ddspec.train.generate import sample_rows

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")], [3.0, float("-inf"), 0.0, 0.5, 1.0]])
    n, temperature = 40_000, 0.7
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_rows(logits, temperature, g) for _ in range(n)])  # [n, 2]
    for row in range(2):
        p = torch.softmax(logits[row] / temperature, dim=-1)
        freq = torch.bincount(draws[:, row], minlength=5).double() / n
        sigma = (p * (1 - p) / n).sqrt()
        assert bool(((freq - p).abs() <= 4 * sigma + 1e-12).all()), (row, freq, p)
    assert int((draws[:, 0] == 4).sum()) == 0 and int((draws[:, 1] == 1).sum()) == 0
    again = sample_rows(logits, temperature, torch.Generator().manual_seed(5))
    assert torch.equal(again, sample_rows(logits, temperature, torch.Generator().manual_seed(5)))


def test_merge_adds_another_runs_data_once_with_its_layer_states(tmp_path, capsys):
    """`train merge --from OTHER` appends OTHER's shards (new sampled passes made in another
    folder) with their fused-layer states; the fit then trains on both; a rerun adds nothing;
    greedy answers RUN already has are skipped; other targets and other layers are refused."""
    from ddspec.train.generate import load_shards

    run, more = tmp_path / "run", tmp_path / "more"
    base = ["--threads", "1", "--tiny", "--fuse-layers", "1"]
    assert main(["train", "data", "--out", str(run), *base]) == 0
    assert main(["train", "data", "--out", str(more), *base, "--sampled-answers", "1", "--first-sampled-pass", "2",
                 "--temperature", "1.0"]) == 0  # its greedy shards repeat run's; its pass 2 is new
    mine, theirs = (json.loads((d / "data" / "manifest.json").read_text()) for d in (run, more))
    new = {k: e for k, e in theirs["shards"].items() if e.get("pass") == 2}
    assert new and len(new) < len(theirs["shards"])
    capsys.readouterr()
    assert main(["train", "merge", "--out", str(run), "--from", str(more), "--threads", "1", "--tiny"]) == 0
    err = capsys.readouterr().err
    assert err.count("which this run's greedy pass has answered already") == len(theirs["shards"]) - len(new)
    merged = json.loads((run / "data" / "manifest.json").read_text())
    assert len(merged["shards"]) == len(mine["shards"]) + len(new)
    assert merged["sequences"] == mine["sequences"] + sum(e["sequences"] for e in new.values())
    ids = [s["id"] for s in load_shards(run / "data")]
    assert ids[: mine["sequences"]] == [s["id"] for s in load_shards(more / "data") if "#" not in s["id"]]
    assert all(i.endswith("#s2") for i in ids[mine["sequences"]:])  # appended: the newest, held out first
    layers = json.loads((run / "data" / "layers.json").read_text())
    assert sorted(layers["shards"]) == sorted(merged["shards"])
    key = sorted(merged["shards"])[-1]
    src_key = merged["shards"][key]["merged_from"].rsplit(":", 1)[1]
    assert torch.equal(torch.load(run / "data" / f"layers-{key}.pt", weights_only=True)[0],
                       torch.load(more / "data" / f"layers-{src_key}.pt", weights_only=True)[0])
    assert main(["train", "fit", "--out", str(run), *base, "--epochs", "0.2", "--val-sequences", "4"]) == 0
    # the newest shards alone give the last n sequences and their layer states (what calibrate reads)
    from ddspec.train.generate import tail_shard_keys
    from ddspec.train.layers import attach_layer_states

    everything = load_shards(run / "data")
    attach_layer_states(everything, run / "data", (1,))
    assert len(tail_shard_keys(run / "data", 1)) == 1
    assert tail_shard_keys(run / "data", len(everything)) == sorted(merged["shards"])
    for n in (1, 4, len(everything)):
        keys = tail_shard_keys(run / "data", n)
        tail = load_shards(run / "data", keys)
        attach_layer_states(tail, run / "data", (1,), keys)
        assert [s["id"] for s in tail[-n:]] == [s["id"] for s in everything[-n:]]
        assert all(torch.equal(a["layers"], b["layers"]) for a, b in zip(tail[-n:], everything[-n:]))
    # a rerun adds nothing; the run's own data stage resumes past its own shards only
    assert main(["train", "merge", "--out", str(run), "--from", str(more), "--threads", "1", "--tiny"]) == 0
    assert json.loads((run / "data" / "manifest.json").read_text())["shards"] == merged["shards"]
    capsys.readouterr()
    # refusals: no --from, another target's data, other fused layers
    assert main(["train", "merge", "--out", str(run), "--threads", "1", "--tiny"]) == 2
    assert "--from" in capsys.readouterr().err
    theirs["target"] = "another:0123"  # the name does not matter, the fingerprint of config and weights does
    (more / "data" / "manifest.json").write_text(json.dumps(theirs))
    assert main(["train", "merge", "--out", str(run), "--from", str(more), "--threads", "1", "--tiny"]) == 2
    assert "another:0123" in capsys.readouterr().err
    theirs["target"] = mine["target"]
    (more / "data" / "manifest.json").write_text(json.dumps(theirs))
    other = json.loads((more / "data" / "layers.json").read_text()) | {"layers": [0]}
    (more / "data" / "layers.json").write_text(json.dumps(other))
    assert main(["train", "merge", "--out", str(run), "--from", str(more), "--threads", "1", "--tiny"]) == 2
    err = capsys.readouterr().err
    assert "[0]" in err and "Traceback" not in err


def test_draft_temperature_fit_recovers_a_known_temperature():
    """Labels drawn as the argmax of logits / 0.5 plus Gumbel noise, i.e. samples of softmax(logits / 0.5):
    the NLL-optimal temperature of the raw logits is 0.5, and the fit finds it."""
    from ddspec.train.trainer import TEMPERATURE_GRID, argmax_nll, best_temperature

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20000, 50, generator=g) * 2
    gumbel = -torch.log(-torch.log(torch.rand(20000, 50, generator=g)))
    labels = (logits / 0.5 + gumbel).argmax(-1)
    inv_t = torch.tensor(TEMPERATURE_GRID).reciprocal()
    nll = argmax_nll(logits, labels, inv_t) / labels.numel()
    assert abs(best_temperature(TEMPERATURE_GRID, nll.tolist()) - 0.5) < 0.04
    reference = -torch.log_softmax(logits / 0.8, -1).gather(1, labels.view(-1, 1)).mean()
    assert abs(float(nll[TEMPERATURE_GRID.index(0.8)]) - float(reference)) < 1e-4
    assert best_temperature((0.5, 1.0, 1.5), [3.0, 2.0, 1.0]) == 1.5  # at the grid's edge: the edge


def test_calibrate_stage_records_the_temperature_the_drafter_uses(tmp_path, capsys):
    from ddspec.draft.checkpoint import load_head
    from ddspec.draft.eagle import head_draft_temperature

    out = tmp_path / "run"
    base = ["--tiny", "--out", str(out), "--threads", "1"]
    assert main(["train", "calibrate", *base, "--val-sequences", "4"]) != 0  # nothing trained yet
    assert "train fit" in capsys.readouterr().err
    assert main(["train", "data", *base]) == 0
    assert main(["train", "fit", *base, "--val-sequences", "4", "--ttt-passes", "2"]) == 0
    assert main(["train", "calibrate", *base]) != 0  # no held-out sequences named
    assert "--val-sequences" in capsys.readouterr().err
    assert main(["train", "calibrate", *base, "--val-sequences", "4"]) == 0
    fit = json.loads((out / "head" / "config.json").read_text())["ddspec"]["draft_temperature"]
    assert 0.3 <= fit["greedy"] <= 1.6 and fit["tokens"] > 0 and fit["depths"] == 2
    assert min(fit["nll"].values()) <= fit["nll"]["1.0"]
    assert "greedy draft temperature" in (out / "calibrate.log").read_text()
    from ddspec.models.loading import load_target

    head = load_head(out / "head", load_target(str(out / "tiny_model"), impl="native").info)
    assert head_draft_temperature(head) == fit["greedy"]
    assert main(["train", "export", *base]) == 0  # the export carries it
    exported = json.loads((out / "export" / "config.json").read_text())["ddspec"]["draft_temperature"]
    assert exported["greedy"] == fit["greedy"]
    assert f"greedy draft temperature: **{fit['greedy']}**" in (out / "export" / "README.md").read_text()


def test_fit_checkpoints_by_wall_time_as_well_as_by_steps(tmp_path, monkeypatch, capsys):
    """--checkpoint-minutes 0 writes train_state.pt after every step even when --checkpoint-every is
    never reached; a long interval writes it only at the end; bad values are refused with a message."""
    from ddspec.train.trainer import HeadTrainer

    saved_at = []
    real = HeadTrainer.save_state
    monkeypatch.setattr(HeadTrainer, "save_state", lambda self: (saved_at.append(self.step), real(self))[1])
    base = ["--tiny", "--threads", "1", "--checkpoint-every", "1000"]
    out = tmp_path / "run"
    assert main(["train", "data", "--out", str(out), *base[:3]]) == 0
    assert main(["train", "fit", "--out", str(out), *base, "--checkpoint-minutes", "0"]) == 0
    steps = saved_at[-1]
    assert steps > 2 and saved_at == list(range(1, steps + 1))
    saved_at.clear()
    other = tmp_path / "other"
    assert main(["train", "data", "--out", str(other), *base[:3]]) == 0
    assert main(["train", "fit", "--out", str(other), *base, "--checkpoint-minutes", "60"]) == 0
    assert saved_at == [steps]
    capsys.readouterr()
    assert main(["train", "fit", "--out", str(out), *base, "--checkpoint-minutes", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint-minutes" in err and "Traceback" not in err


def test_a_kept_draft_vocabulary_is_recorded_in_the_training_settings(tmp_path):
    """--keep-draft-vocab trains over the earlier head's d2t: the head's config records that size,
    not the --draft-vocab default of 0 (the full vocabulary)."""
    from ddspec.draft.checkpoint import random_head, save_head
    from ddspec.models.loading import load_target

    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    target = load_target(str(out / "tiny_model"), impl="native")
    earlier = random_head(target.hf_config, seed=3)
    earlier.register_buffer("d2t", torch.arange(0, 64, 2) - torch.arange(32))  # 32 draft tokens
    save_head(earlier, tmp_path / "earlier")
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--init-from",
                 str(tmp_path / "earlier"), "--keep-draft-vocab"]) == 0
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["ddspec"]["training"]["settings"]["draft_vocab"] == 32


def test_second_turns_follow_the_greedy_answers(tmp_path, capsys):
    from ddspec.train.generate import load_shards

    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--second-turns", "3"]) == 0
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert any(e.get("turn") == 2 for e in manifest["shards"].values())
    seqs = load_shards(out / "data")
    firsts = {s["id"]: s for s in seqs if "#" not in s["id"]}
    seconds = [s for s in seqs if s["id"].endswith("#t2")]
    assert len(seconds) == 3 and len(firsts) + 3 == len(seqs)
    for s in seconds:
        first = firsts[s["id"][: -len("#t2")]]
        n = first["prompt_len"]
        # the chat opens with the first prompt and holds the first answer before the new user turn
        assert s["input_ids"][:n].tolist() == first["input_ids"][:n].tolist()
        assert s["prompt_len"] > len(first["input_ids"]) - 1
        assert s["features"].shape[0] == len(s["input_ids"]) - 1
    assert "second turns: 3 greedy answers" in (out / "data.log").read_text()
    # a rerun resumes: nothing new; a negative count is refused before any work
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--second-turns", "3"]) == 0
    assert json.loads((out / "data" / "manifest.json").read_text())["sequences"] == manifest["sequences"]
    capsys.readouterr()
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1", "--second-turns", "-1"]) != 0
    assert "--second-turns must be 0 or more" in capsys.readouterr().err

"""Heads that fuse intermediate target layers into their input feature (``--fuse-layers``)."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.cli import main
from ddspec.config import StopConfig, TreeConfig
from ddspec.draft.checkpoint import load_head, random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.errors import DdspecError

TREE = TreeConfig(top_k=4, depth=4, total_tokens=16)


def _fused_head(target, layers=(1,), seed=5):
    head = random_head(target.hf_config, seed=seed, std=0.05, fuse_layers=layers)
    with torch.no_grad():
        head.fuse.weight.normal_(0.0, 0.05)
    return head.eval().requires_grad_(False)


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_drafting_reads_the_fused_layers_as_training_does(tiny_targets, impl, monkeypatch):
    """The root's f̂ after prefill equals the training forward fed the layers stage's stored states."""
    monkeypatch.setenv("DDSPEC_DRAFT_WEIGHTS", "exact")  # the head's own values (Q8_0 drafting approximates them)
    from ddspec.train.layers import layer_states

    target = tiny_targets[("llama", impl)]
    native = tiny_targets[("llama", "native")]
    head = _fused_head(target)
    drafter = EagleDrafter(head, target, TREE)
    assert drafter.hidden_layers == (1,)
    prompt = torch.tensor([3, 17, 29, 8, 41, 5, 66, 12])
    root = torch.tensor(9)
    target.reset(64)
    out = target.forward(prompt, torch.arange(len(prompt)), None, drafter.hidden_layers)
    drafter.reset(64)
    drafter.prefill(prompt, out, root)
    fast, plain_maths = drafter.packed.committed_features(out, torch.tensor([0, 3, 7])), head.committed_features(out, torch.tensor([0, 3, 7]))
    assert torch.allclose(fast, plain_maths, atol=1e-5, rtol=1e-5)  # the fuse matmul on the planned kernel
    seq = torch.cat([prompt, root.view(1)])
    stored = layer_states(native, [seq], (1,))[0]  # what `ddspec train layers` writes: [len - 1, n * H] fp16
    with torch.no_grad():
        feats = head.fused_features(out.features.float(), stored.float())
        trained = head(target.embed(seq[1:]).view(1, len(prompt), -1).float(), feats.unsqueeze(0),
                       torch.arange(len(prompt)))[0]
        plain = head(target.embed(seq[1:]).view(1, len(prompt), -1).float(), out.features.float().unsqueeze(0),
                     torch.arange(len(prompt)))[0]
    assert torch.allclose(drafter.root_hidden, trained[-1], atol=2e-2, rtol=1e-2)
    assert not torch.allclose(drafter.root_hidden, plain[-1], atol=2e-2, rtol=1e-2)  # the fusion does count


def test_fused_head_is_lossless_and_starts_as_the_plain_head(tiny_targets):
    target = tiny_targets[("llama", "native")]
    prompt = [5, 6, 7, 8, 9, 10]
    stop = StopConfig(max_new_tokens=24)
    ref = Engine(target).generate(prompt, stop)
    fused = _fused_head(target)
    res = Engine(target, EagleDrafter(fused, target, TREE)).generate(prompt, stop)
    assert res.token_ids == ref.token_ids
    zero = _fused_head(target)
    with torch.no_grad():
        zero.fuse.weight.zero_()
    plain = random_head(target.hf_config, seed=0).eval()
    plain.load_state_dict({k: v for k, v in zero.state_dict().items() if k != "fuse.weight"})
    a = Engine(target, EagleDrafter(zero, target, TREE)).generate(prompt, stop).stats
    b = Engine(target, EagleDrafter(plain, target, TREE)).generate(prompt, stop).stats
    assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]


def test_tiny_pipeline_with_fused_layers(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--tiny", "--out", str(out), "--threads", "1", "--fuse-layers", "1"]
    assert main(["train", "all", *args]) == 0
    stages = json.loads((out / "stages.json").read_text())
    assert set(stages) == {"data", "layers", "fit", "eval", "export"}
    assert json.loads((out / "eval.json").read_text())["head"]["tiny"]["identical_to_plain"] == "4/4"
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["fuse_layers"] == [1]
    assert "Fused features" in (out / "export" / "README.md").read_text()
    from ddspec.models.loading import load_target

    target = load_target(str(out / "tiny_model"), impl="native")
    head = load_head(out / "export", target.info)
    assert head.fuse_layers == (1,) and head.fuse.weight.abs().max() > 0  # trained away from its zero start
    # the layers stage resumes (nothing to redo) and refuses other layers than the ones on disk
    assert main(["train", "layers", *args]) == 0
    capsys.readouterr()
    assert main(["train", "layers", "--tiny", "--out", str(out), "--threads", "1", "--fuse-layers", "1,0"]) == 2
    assert "between 1 and 1" in capsys.readouterr().err
    # a fused head as the warm start of a plain run is refused with the flag to pass
    assert main(["train", "fit", "--tiny", "--out", str(tmp_path / "other"), "--threads", "1",
                 "--init-from", str(out / "export")]) == 2


def test_fit_without_the_layers_stage_says_what_to_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "data", "--tiny", "--out", str(out), "--threads", "1"]) == 0
    capsys.readouterr()
    assert main(["train", "fit", "--tiny", "--out", str(out), "--threads", "1", "--fuse-layers", "1"]) == 2
    assert "ddspec train layers" in capsys.readouterr().err


def test_parse_layers():
    from ddspec.train.layers import parse_layers

    assert parse_layers("15,2", 30) == (2, 15)
    assert parse_layers(None, 30) == ()
    for bad in ("0", "30", "a,b", ","):
        with pytest.raises(DdspecError):
            parse_layers(bad, 30)


def test_data_stage_keeps_the_fused_layers_as_the_layers_stage_computes_them(tmp_path, capsys):
    """`train data --fuse-layers` writes layers-*.pt beside each shard, equal (to fp16 rounding)
    to what the layers stage computes from scratch; the layers stage then has nothing to redo,
    fills only shards written without them, and other layers or an EAGLE-3 run are refused."""
    from ddspec.models.loading import load_target
    from ddspec.train.layers import layer_states

    out = tmp_path / "run"
    base = ["--tiny", "--out", str(out), "--threads", "1"]
    assert main(["train", "data", *base, "--fuse-layers", "1"]) == 0
    data = out / "data"
    shards = sorted(json.loads((data / "manifest.json").read_text())["shards"])
    kept = json.loads((data / "layers.json").read_text())
    assert len(shards) > 1 and kept["layers"] == [1] and sorted(kept["shards"]) == shards
    target = load_target(str(out / "tiny_model"), impl="native")
    for key in shards:
        shard = torch.load(data / f"shard-{key}.pt", weights_only=True)
        stored = torch.load(data / f"layers-{key}.pt", weights_only=True)
        fresh = layer_states(target, [s["input_ids"] for s in shard], (1,))
        assert len(stored) == len(shard) == len(fresh)
        for seq, a, b in zip(shard, stored, fresh):
            assert a.dtype == torch.float16 and a.shape == b.shape == (seq["features"].shape[0], 64)
            assert float((a.float() - b.float()).abs().max()) < 1e-2  # normalised: entries of order 1
    # a shard that lost its states (say, written by a run without --fuse-layers): the layers stage
    # computes that one only
    (data / f"layers-{shards[1]}.pt").unlink()
    kept["shards"].pop(shards[1])
    (data / "layers.json").write_text(json.dumps(kept))
    before = {k: (data / f"layers-{k}.pt").stat().st_mtime_ns for k in shards if k != shards[1]}
    assert main(["train", "layers", *base, "--fuse-layers", "1"]) == 0
    assert sorted(json.loads((data / "layers.json").read_text())["shards"]) == shards
    assert before == {k: (data / f"layers-{k}.pt").stat().st_mtime_ns for k in before}
    assert (data / f"layers-{shards[1]}.pt").is_file()
    capsys.readouterr()
    assert main(["train", "data", *base, "--fuse-layers", "1", "--sampled-answers", "1"]) == 0  # resumes, same layers
    more = sorted(json.loads((data / "manifest.json").read_text())["shards"])
    assert len(more) > len(shards) and sorted(json.loads((data / "layers.json").read_text())["shards"]) == more
    capsys.readouterr()
    (data / "layers.json").write_text(json.dumps(kept | {"layers": [0]}))  # states of other layers on disk
    assert main(["train", "data", *base, "--fuse-layers", "1", "--sampled-answers", "2"]) == 2
    assert "[0]" in capsys.readouterr().err
    assert main(["train", "data", "--tiny", "--out", str(tmp_path / "e3"), "--threads", "1", "--arch", "eagle3",
                 "--fuse-layers", "1"]) == 2
    assert "--fuse-layers" in capsys.readouterr().err


def test_an_unfinished_fused_deeper_run_evaluates_and_exports_its_checkpoint(tmp_path, capsys):
    """Before `fit` writes RUN/head, eval and export read train_state.pt: the head is rebuilt with
    the depth and fused layers it was trained with (a one-layer plain head cannot take its
    weights). A folder with no training at all gets the command to run, not a traceback."""
    out = tmp_path / "run"
    base = ["--tiny", "--out", str(out), "--threads", "1"]
    assert main(["train", "data", *base, "--fuse-layers", "1"]) == 0
    assert main(["train", "fit", *base, "--fuse-layers", "1", "--head-layers", "2", "--epochs", "0.2"]) == 0
    import shutil

    shutil.rmtree(out / "head")  # as if the fit had been stopped before its end
    capsys.readouterr()
    assert main(["train", "eval", *base]) == 0
    assert "evaluating the checkpoint" in capsys.readouterr().err
    assert json.loads((out / "eval.json").read_text())["head"]["tiny"]["identical_to_plain"] == "4/4"
    assert main(["train", "export", *base]) == 0
    from ddspec.models.loading import load_target

    head = load_head(out / "export", load_target(str(out / "tiny_model"), impl="native").info)
    assert len(head.layers) == 2 and head.fuse_layers == (1,)
    capsys.readouterr()
    for stage in ("eval", "export"):
        assert main(["train", stage, "--tiny", "--out", str(tmp_path / "empty"), "--threads", "1"]) == 2
        err = capsys.readouterr().err
        assert "ddspec train fit" in err and "Traceback" not in err

"""Heads of more than one decoder layer (``--head-layers``), warm-started as the identity."""

from __future__ import annotations

import json

import torch

from ddspec.cli import main
from ddspec.config import StopConfig, TreeConfig
from ddspec.draft.checkpoint import add_identity_layers, load_head, random_head, save_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine

TREE = TreeConfig(top_k=4, depth=4, total_tokens=16)


def _outputs(head, target, n=7):
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, n, target.info.hidden_size, generator=gen)
    toks = torch.randint(0, target.info.vocab_size, (n,), generator=gen)
    with torch.no_grad():
        return head(target.embed(toks).view(1, n, -1).float(), feats, torch.arange(n))


def test_a_deeper_head_round_trips_and_stays_lossless(tiny_targets, tmp_path):
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config, seed=4, std=0.05, layers=2).eval()
    assert "layers.1.input_layernorm.weight" in head.state_dict()
    assert "layers.0.input_layernorm.weight" not in head.state_dict()  # the first layer has none (EAGLE layout)
    save_head(head, tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["num_hidden_layers"] == 2
    loaded = load_head(tmp_path / "h", target.info)
    assert len(loaded.layers) == 2 and torch.equal(_outputs(head, target), _outputs(loaded, target))
    prompt, stop = [5, 6, 7, 8, 9, 10], StopConfig(max_new_tokens=24)
    ref = Engine(target).generate(prompt, stop)
    res = Engine(target, EagleDrafter(loaded, target, TREE)).generate(prompt, stop)
    assert res.token_ids == ref.token_ids


def test_added_layers_start_as_the_identity(tiny_targets):
    target = tiny_targets[("llama", "native")]
    shallow = random_head(target.hf_config, seed=2, std=0.05).eval()
    deep = random_head(target.hf_config, seed=9, std=0.05, layers=2).eval()
    missing, unexpected = deep.load_state_dict(shallow.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.1.") for k in missing)
    assert not torch.allclose(_outputs(deep, target), _outputs(shallow, target))  # layer 1 still counts
    add_identity_layers(deep, shallow)
    assert torch.allclose(_outputs(deep, target), _outputs(shallow, target), atol=1e-6)
    # drafting with it accepts exactly what the shallow head accepts
    prompt, stop = [3, 1, 4, 1, 5, 9, 2, 6], StopConfig(max_new_tokens=20)
    a = Engine(target, EagleDrafter(deep, target, TREE)).generate(prompt, stop).stats
    b = Engine(target, EagleDrafter(shallow, target, TREE)).generate(prompt, stop).stats
    assert [s.accepted for s in a.steps] == [s.accepted for s in b.steps]


def test_fit_deepens_a_warm_start(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    base = ["--tiny", "--out", str(out), "--threads", "1"]
    for stage in ("data", "fit"):
        assert main(["train", stage, *base]) == 0
    shutil.move(out / "head", tmp_path / "round1")
    cold = torch.load(out / "train_state.pt", weights_only=False)["history"]
    (out / "train_state.pt").unlink()
    capsys.readouterr()
    assert main(["train", "fit", *base, "--init-from", str(tmp_path / "round1"), "--head-layers", "2"]) == 0
    assert "2-layer head" in capsys.readouterr().err
    warm = torch.load(out / "train_state.pt", weights_only=False)["history"]
    assert warm[0]["loss"] < cold[0]["loss"]  # it starts at the shallow head, not at chance
    cfg = json.loads((out / "head" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    # the new layer trained away from its identity start
    state = torch.load(out / "train_state.pt", weights_only=False)["head"]
    assert state["layers.1.mlp.down_proj.weight"].abs().max() > 0
    # a deeper head cannot be squeezed into fewer layers; a bad count is refused by name
    shutil.move(out / "head", tmp_path / "round2")
    for bad in (["--head-layers", "1", "--init-from", str(tmp_path / "round2")], ["--head-layers", "9"]):
        assert main(["train", "fit", *base, *bad]) == 2
        assert "--head-layers" in capsys.readouterr().err

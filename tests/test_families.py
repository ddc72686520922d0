"""The native forward of the families beyond Llama: Qwen3, Gemma 1/2/3, Phi-3, and Mistral with a
sliding window. Tiny random models built with transformers' own classes; the windows (8 tokens)
are shorter than the sequences, so the windowed layers' masks matter."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.config import StopConfig
from ddspec.draft.checkpoint import random_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.engine import Engine
from ddspec.methods import METHODS, make_drafter, tree_config
from test_models import assert_tree_rows_equal_their_paths
from test_spec_engine import SMALL, eagle

FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3", "phi3", "mistral")
WINDOW = 8
TOL = 1e-4


def _shape(family: str) -> dict:
    return dict(layers=6 if family == "gemma3" else 2, max_position=128,
                sliding_window=None if family in ("qwen3", "gemma") else WINDOW)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from ddspec.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_model_dir(root / f, f, seed=20 + i, **_shape(f)) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def family_targets(family_dirs):
    from ddspec.models.loading import load_target

    return {(f, impl): load_target(str(d), impl=impl) for f, d in family_dirs.items() for impl in ("native", "hf")}


def test_every_family_runs_native_with_its_windows(family_targets):
    windows = {f: family_targets[(f, "native")].arch.windows for f in FAMILIES}
    assert windows["gemma3"] == (WINDOW,) * 5 + (0,)  # five local layers to one global
    assert windows["gemma2"] == (WINDOW, 0) and windows["phi3"] == windows["mistral"] == (WINDOW, WINDOW)
    assert windows["qwen3"] == windows["gemma"] == (0, 0)
    for f in FAMILIES:
        assert type(family_targets[(f, "native")]).__name__ == "NativeLlama"


@pytest.mark.parametrize("kernel", ["native", "linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_native_matches_transformers_over_prefill_and_steps(family_dirs, family_targets, family, kernel, monkeypatch):
    """Logits and features equal transformers' own forward (its masks, its windows) within TOL: a
    23-token prefill, then one token at a time past the window."""
    from ddspec.models.loading import load_target

    monkeypatch.setenv("DDSPEC_KERNEL", kernel)
    native = load_target(str(family_dirs[family]), impl="native")
    assert native.layer_plan.needed == {kernel}
    model = family_targets[(family, "hf")].model
    tokens = torch.randint(0, native.info.vocab_size, (27,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=tokens.view(1, -1), output_hidden_states=True)
    logits, features = ref.logits[0], ref.hidden_states[-1][0]
    native.reset(64)
    out = native.forward(tokens[:23], torch.arange(23))
    native.commit(torch.arange(23))
    assert (out.logits - logits[:23]).abs().max() <= TOL
    assert (out.features - features[:23]).abs().max() <= TOL
    assert out.logits.std() > 0.1  # not a degenerate model
    for i in range(23, 27):
        step = native.forward(tokens[i:i + 1], torch.tensor([i]))
        native.commit(torch.tensor([0]))
        assert (step.logits[0] - logits[i]).abs().max() <= TOL, f"step at position {i}"


@pytest.mark.parametrize("impl", ["native", "hf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_rows_equal_their_paths_past_the_window(family_targets, family, impl):
    """A 14-node tree after 12 tokens (deeper than the 8-token window): every row's logits equal its
    path decoded alone, for the native forward and for the HF adapter's per-layer-type masks."""
    assert_tree_rows_equal_their_paths(family_targets[(family, impl)], cached=12)


def test_the_hf_adapter_applies_the_windows(family_targets):
    """The adapter's decoding equals transformers' own forward past the window (its cache keeps
    every key; its masks hide what each layer type's window hides)."""
    for family in ("gemma3", "mistral"):
        adapter = family_targets[(family, "hf")]
        tokens = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            ref = adapter.model(input_ids=tokens.view(1, -1)).logits[0]
        adapter.reset(64)
        adapter.forward(tokens[:16], torch.arange(16))
        adapter.commit(torch.arange(16))
        for i in range(16, 20):
            out = adapter.forward(tokens[i:i + 1], torch.tensor([i]))
            adapter.commit(torch.tensor([0]))
            assert (out.logits[0] - ref[i]).abs().max() <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_equals_plain_decoding(family_targets, family):
    """Greedy: plain decoding, lookup and every head method (a random head in the family's shape,
    so its drafts are mostly rejected and the trees exercise the masks) give the same tokens."""
    target = family_targets[(family, "native")]
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    prompt = [5, 17, 33, 8, 90, 5, 17, 33, 8, 91, 5, 17]  # repeats itself: lookup drafts
    ref = Engine(target).generate(prompt, stop).token_ids
    for method in (m for m in METHODS if m != "vanilla"):
        drafter = make_drafter(method, target, None) if method == "lookup" else eagle(target, method)
        assert Engine(target, drafter).generate(prompt, stop).token_ids == ref, method


def test_a_head_for_any_family_is_built_from_llama_layers(family_targets):
    """A head for a Gemma target: Llama layers (no (1 + w) norms, windows or soft-capping), the
    target's global RoPE; its draft trees verify losslessly (above)."""
    target = family_targets[("gemma2", "native")]
    head = random_head(target.hf_config, seed=0)
    assert head.config["model_type"] == "llama" and head.arch.windows == (0,)
    assert not head.arch.norm_offset and head.arch.activation == "silu" and not head.arch.attn_softcap
    drafter = EagleDrafter(head.eval().requires_grad_(False), target, tree_config("eagle2", SMALL))
    stop = StopConfig(max_new_tokens=12, stop_on_eos=False)
    assert Engine(target, drafter).generate([3, 4, 5], stop).token_ids == Engine(target).generate([3, 4, 5], stop).token_ids


def test_unsupported_families_name_why_they_run_through_transformers(tmp_path, capsys):
    from ddspec.models.llama import why_not_native
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    d = make_tiny_model_dir(tmp_path / "m", "llama", seed=0)
    cfg = json.loads((d / "config.json").read_text())
    assert why_not_native(cfg) is None
    assert "no native table" in why_not_native({**cfg, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert "'gpt2' has no native forward" in why_not_native({**cfg, "model_type": "gpt2"})
    (d / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                          "rope_theta": 10000.0}}))
    target = load_target(str(d))
    assert type(target).__name__ == "HFTarget"
    assert "through transformers" in capsys.readouterr().err and "'dynamic' has no native table" in str(
        why_not_native(json.loads((d / "config.json").read_text())))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_pipeline_on_another_family(tmp_path, family):
    """ddspec train makes a head for a tiny model of the family, end to end (data, fit, eval, export),
    and its eval finds every answer identical to plain decoding."""
    from ddspec.cli import main

    out = tmp_path / "run"
    assert main(["train", "all", "--tiny", "--tiny-family", family, "--out", str(out), "--threads", "1"]) == 0
    r = json.loads((out / "eval.json").read_text())["head"]["tiny"]
    assert r["identical_to_plain"] == "4/4" and r["tau"] >= 1.0


@pytest.mark.parametrize("sessions", [False, True])
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_training_data_generation_keeps_the_windows(family_targets, family, sessions):
    """The batched generator of training data (left-padded rows, a shared cache) answers as plain
    decoding does past the window, and its features are a full forward's."""
    from ddspec.train.generate import check_features_match, generate_batch

    target = family_targets[(family, "native")]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32, 33, 34]]
    results = generate_batch(target, prompts, 14, rows=2, max_prompt=10, sessions=sessions)
    for p, (resp, feats, _) in zip(prompts, results):
        assert resp == Engine(target).generate(p, StopConfig(max_new_tokens=14)).token_ids
        assert check_features_match(target, feats, torch.tensor(p + resp)) < 1e-4


def test_a_published_eagle3_head_loads_on_a_gemma3_target(family_targets, tmp_path):
    """An EAGLE-3 head in the published layout (d2t / t2d, the default layer ids of a 6-layer
    target) loads for a Gemma 3 target and every method stays lossless with it."""
    from ddspec.draft.checkpoint import load_head
    from ddspec.draft.eagle3 import Eagle3Head
    from test_eagle3 import _drafter, published_head

    target = family_targets[("gemma3", "native")]
    published_head(tmp_path, target, seed=1)
    head = load_head(tmp_path, target.info)
    assert isinstance(head, Eagle3Head) and head.hidden_layers == (2, 3, 3)
    stop = StopConfig(max_new_tokens=20, stop_on_eos=False)
    prompt = [5, 17, 33, 8, 90, 41, 12, 60, 61, 62]
    ref = Engine(target).generate(prompt, stop).token_ids
    for method in (m for m in METHODS if m not in ("vanilla", "lookup")):
        assert Engine(target, _drafter(target, head, method)).generate(prompt, stop).token_ids == ref, method


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_the_familys_gguf_file_runs_native_in_fp32_and_int8(tmp_path, arch):
    """A tiny model of the family written as llama.cpp writes it (gguf-py): in F32, the native
    forward from the GGUF equals the model's own logits; in Q8_0 blocks, the native fp32 forward equals
    transformers' on the converted folder, the int8 mode stays near it, and in int8 every method's
    greedy output equals plain decoding (Gemma's windows of 4 tokens, shorter than the sequences)."""
    import gguf

    from ddspec.models.loading import load_target
    from test_gguf_convert import tiny_model, write_from_model

    # (a Phi-3 GGUF has no window: llama.cpp runs Phi-3 without one, and so does its conversion)
    settings = dict(sliding_window=4) if arch in ("gemma2", "gemma3") else {}
    if arch == "gemma3":
        settings["num_hidden_layers"] = 6
    model = tiny_model(arch, "bpe", **settings)
    tokens = torch.randint(0, model.config.vocab_size, (21,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=tokens.view(1, -1)).logits[0]
    write_from_model(tmp_path / "f32.gguf", model, arch, "bpe")
    target = load_target(str(tmp_path / "f32.gguf"))
    assert type(target).__name__ == "NativeLlama"
    target.reset(64)
    assert (target.forward(tokens, torch.arange(21)).logits - ref).abs().max() <= TOL

    write_from_model(tmp_path / "q8.gguf", model, arch, "bpe", qtype=int(gguf.GGMLQuantizationType.Q8_0))
    outs = {}
    for impl, act in (("hf", "fp32"), ("native", "fp32"), ("native", "int8")):
        t = load_target(str(tmp_path / "q8.gguf"), impl=impl, activations=act)
        t.reset(64)
        outs[impl, act] = t.forward(tokens, torch.arange(21)).logits
    assert (outs["native", "fp32"] - outs["hf", "fp32"]).abs().max() <= TOL
    scale = outs["native", "fp32"].abs().max()
    assert (outs["native", "int8"] - outs["native", "fp32"]).abs().max() <= 0.05 * scale
    assert t.layers[0].qkv.native.kind == "q8_0a8"
    stop = StopConfig(max_new_tokens=20, stop_on_eos=False)
    prompt = [5, 17, 33, 8, 90, 5, 17, 33, 8, 91]
    plain_ids = Engine(t).generate(prompt, stop).token_ids
    for method in ("chain", "eagle2", "ddd", "ddspec", "lookup"):
        drafter = make_drafter(method, t, None) if method == "lookup" else eagle(t, method)
        assert Engine(t, drafter).generate(prompt, stop).token_ids == plain_ids, method

"""EAGLE-3 heads in the published layout: loading, every method lossless, tree scores equal a plain
sequential reference written from the description, bad checkpoints, layer-id conventions, export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.draft.checkpoint import load_head
from ddspec.draft.eagle import EagleDrafter
from ddspec.draft.eagle3 import Eagle3Head
from ddspec.draft.eagle3_checkpoint import save_eagle3_head
from ddspec.engine import Engine
from ddspec.errors import DdspecError, ModelLoadError
from ddspec.methods import METHODS, make_drafter, tree_config
from ddspec.sampling import target_probs
from ddspec.tree.cost import AcceptanceModel, CostAwarePolicy, CostModel, flat_cost, linear_cost

LAYERS = 8  # default captured layers of an 8-layer target: 2, 4, 5
DEFAULT_LAYERS = (2, 4, 5)
SPEC_METHODS = [m for m in METHODS if m != "vanilla"]
PROMPT = [5, 17, 33, 8, 90, 41, 12]
SMALL = TreeConfig(top_k=4, depth=4, total_tokens=14, ddd_check_depths=(2, 4), max_depth=5)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny 8-layer Llama target (the tiny fixtures have 2 layers, too few for L - 3): (dir, native target)."""
    from ddspec.models.loading import load_target
    from ddspec.models.tiny import make_tiny_model_dir

    folder = make_tiny_model_dir(tmp_path_factory.mktemp("deep") / "llama8", "llama", seed=11, layers=LAYERS)
    return folder, load_target(str(folder), impl="native")


# -- a head written by hand in the published layout -------------------------------------------

def published_head(folder: Path, target, *, seed: int = 0, arch: str = "LlamaForCausalLMEagle3",
                   prefix: str = "midlayer.", fmt: str = "safetensors", dtype=torch.bfloat16,
                   draft_ids: torch.Tensor | None = None, config_extra: dict | None = None,
                   drop: tuple[str, ...] = (), fc_width: int | None = None) -> dict[str, torch.Tensor]:
    """Write config.json + weights exactly as the EAGLE / SpecForge checkpoints lay them out
    (no rope_theta, bf16/fp16 weights); returns the tensors as stored, in fp32 (for the reference)."""
    g = torch.Generator().manual_seed(seed)
    tc = target.hf_config
    h, v = tc["hidden_size"], tc["vocab_size"]
    nh, nkv = tc["num_attention_heads"], tc["num_key_value_heads"]
    d = h // nh
    if draft_ids is None:  # a sorted draft vocabulary: most of the target's, so d2t holds real offsets
        draft_ids = torch.randperm(v, generator=g)[: v - 24].sort().values
    vd = draft_ids.numel()

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def norm_w():
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    inter = tc["intermediate_size"]
    t = {
        "fc.weight": w(h, fc_width or 3 * h, std=0.1),
        f"{prefix}hidden_norm.weight": norm_w(),
        f"{prefix}input_layernorm.weight": norm_w(),
        f"{prefix}post_attention_layernorm.weight": norm_w(),
        f"{prefix}self_attn.q_proj.weight": w(nh * d, 2 * h),
        f"{prefix}self_attn.k_proj.weight": w(nkv * d, 2 * h),
        f"{prefix}self_attn.v_proj.weight": w(nkv * d, 2 * h),
        f"{prefix}self_attn.o_proj.weight": w(h, nh * d),
        f"{prefix}mlp.gate_proj.weight": w(inter, h),
        f"{prefix}mlp.up_proj.weight": w(inter, h),
        f"{prefix}mlp.down_proj.weight": w(h, inter),
        "norm.weight": norm_w(),
        "lm_head.weight": w(vd, h, std=0.5),
    }
    t = {k: x.to(dtype) for k, x in t.items()}
    t["d2t"] = draft_ids - torch.arange(vd)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    t["t2d"] = t2d
    for k in drop:
        t.pop(k)
    cfg = {
        "architectures": [arch], "model_type": "llama", "hidden_act": "silu", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "num_hidden_layers": 1, "rms_norm_eps": tc["rms_norm_eps"], "vocab_size": v, "draft_vocab_size": vd,
        "max_position_embeddings": 2048, "torch_dtype": str(dtype).removeprefix("torch."), "bias": False,
        **(config_extra or {}),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(t, str(folder / "model.safetensors"))
    else:
        torch.save(t, folder / "pytorch_model.bin")
    return {k.replace(prefix, "midlayer."): (x.float() if x.is_floating_point() else x) for k, x in t.items()}


# -- the reference: the head written plainly from the description, no cache -------------------

def _rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, base=10000.0):  # x [T, n, D]; rotate-half RoPE, base 10000 (no rope_theta)
    dim = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = positions.double()[:, None] * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference_outputs(t: dict, cfg: dict, embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The head over a whole sequence, causal, no cache: embeds [T, H] of token_{t+1}, g [T, H] its
    hidden input (fc of the captured states, or a parent's output); returns h [T, H] (pre-norm)."""
    eps, nh, nkv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    T, H = g.shape
    d = H // nh
    x = torch.cat([_rms(embeds, t["midlayer.input_layernorm.weight"], eps),
                   _rms(g, t["midlayer.hidden_norm.weight"], eps)], -1)  # EAGLE: cat((input_emb, hidden))
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(T, nh, d)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, d)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, d)
    pos = torch.arange(T)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * d)
    h = g + attn @ t["midlayer.self_attn.o_proj.weight"].T
    hn = _rms(h, t["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(hn @ t["midlayer.mlp.gate_proj.weight"].T) * (hn @ t["midlayer.mlp.up_proj.weight"].T))
    return h + mlp @ t["midlayer.mlp.down_proj.weight"].T


def reference_logprobs(t: dict, cfg: dict, h: torch.Tensor) -> torch.Tensor:
    """log q over the draft vocabulary from h [H]: lm_head(norm(h))."""
    return torch.log_softmax(_rms(h, t["norm.weight"], cfg["rms_norm_eps"]) @ t["lm_head.weight"].T, -1)


def hf_captured(folder: Path, prompt: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """cat of HF transformers' hidden_states[i] for the captured layers: [P, 3H] (independent of ddspec)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], -1)


# -- loading and every method --------------------------------------------------------------

def _drafter(target, head, method: str):
    cfg = tree_config(method, SMALL)
    if cfg.depth_policy != "cost":
        return EagleDrafter(head, target, cfg)
    cost = CostModel(linear_cost(2.0, 0.05), draft_root_ms=0.1, draft_level_ms=0.2, other_ms=0.1)
    policy = CostAwarePolicy(cost, AcceptanceModel(), max_depth=cfg.max_depth, max_tokens=cfg.total_tokens)
    return EagleDrafter(head, target, cfg, cost_policy=policy)


VARIANTS = [  # (architectures spelling, key prefix, file format, stored dtype)
    ("LlamaForCausalLM", "midlayer.", "bin", torch.float16),
    ("LlamaForCausalLMEagle3", "midlayer.", "safetensors", torch.bfloat16),
    ("LlamaForCausalLMEagle3", "layers.0.", "safetensors", torch.float16),
    ("LlamaForCausalLM", "layers.0.", "bin", torch.bfloat16),
]


@pytest.mark.parametrize("arch, prefix, fmt, dtype", VARIANTS)
def test_published_head_loads_and_every_method_equals_plain(deep, tmp_path, arch, prefix, fmt, dtype):
    _, target = deep
    stored = published_head(tmp_path, target, seed=1, arch=arch, prefix=prefix, fmt=fmt, dtype=dtype)
    head = load_head(tmp_path, target.info)
    assert isinstance(head, Eagle3Head) and head.hidden_layers == DEFAULT_LAYERS
    assert head.fc.weight.dtype == torch.float32 and head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    for name, value in head.state_dict().items():
        assert torch.equal(value, stored[name]), name
    assert head.arch.rope_theta == 10000.0  # no rope_theta in the config: the head's own default
    assert torch.equal(head.draft_token_ids, torch.nonzero(stored["t2d"]).flatten())
    stop = StopConfig(max_new_tokens=24, stop_on_eos=False)
    ref = Engine(target).generate(PROMPT, stop).token_ids
    for method in SPEC_METHODS:
        drafter = _drafter(target, head, method)
        res = Engine(target, drafter).generate(PROMPT, stop)
        assert res.token_ids == ref, method
        if method != "ddspec":  # the cost-aware policy may rightly verify the root alone
            assert all(s.tree_size > 1 for s in res.stats.steps), method
            tree = drafter.propose(torch.tensor(ref[-1]), drafter.cache.length)
            assert set(tree.tokens[1:].tolist()) <= set(head.draft_token_ids.tolist())  # in the draft vocabulary


def test_make_drafter_and_the_cost_aware_method_calibrate_for_it(deep, tmp_path, monkeypatch):
    monkeypatch.setenv("DDSPEC_CACHE", str(tmp_path / "cache"))
    _, target = deep
    published_head(tmp_path / "head", target, seed=2)
    drafter = make_drafter("ddspec", target, str(tmp_path / "head"), SMALL)  # --head FOLDER
    assert isinstance(drafter.head, Eagle3Head) and drafter.hidden_layers == DEFAULT_LAYERS
    assert len(list((tmp_path / "cache" / "costs").glob("*.json"))) == 1
    stop = StopConfig(max_new_tokens=20, stop_on_eos=False)
    ref = Engine(target).generate(PROMPT, stop).token_ids
    drafter.cost_policy.cost = CostModel(flat_cost(20.0), draft_root_ms=0.1, draft_level_ms=0.1)
    assert Engine(target, drafter).generate(PROMPT, stop).token_ids == ref


@pytest.mark.parametrize("method", ["eagle2", "eagle", "chain", "ddd"])
def test_tree_scores_equal_a_plain_sequential_reference(deep, tmp_path, method):
    """Each node's score from tree drafting (KV cache, tree masks, positions, fc only at committed
    positions, d2t) equals the sum of log q along its path from the plain, cache-free reference
    above, fed with HF transformers' own hidden_states."""
    folder, target = deep
    stored = published_head(tmp_path, target, seed=3, dtype=torch.float16)
    cfg = json.loads((tmp_path / "config.json").read_text())
    head = load_head(tmp_path, target.info)
    drafter = EagleDrafter(head, target, tree_config(method, SMALL))
    prompt = torch.tensor(PROMPT)
    p = len(PROMPT)
    target.reset(64)
    out = target.forward(prompt, torch.arange(p), None, drafter.hidden_layers)
    root = out.logits[-1].argmax()
    drafter.reset(64)
    drafter.prefill(prompt, out, root)
    tree = drafter.propose(root, p)
    assert tree.size > 3

    draft_of = {int(tid): i for i, tid in enumerate(torch.nonzero(stored["t2d"]).flatten())}
    embed = target.embed
    g0 = hf_captured(folder, PROMPT, DEFAULT_LAYERS) @ stored["fc.weight"].T  # [P, H]
    tokens0 = torch.cat([prompt[1:], root.view(1)])  # token_{t+1} of each committed entry
    for node in range(1, tree.size):
        path = tree.path_to(node).tolist()
        g, toks, score = g0, tokens0, 0.0
        for n in path[1:]:
            with torch.no_grad():
                h = reference_outputs(stored, cfg, embed(toks), g)
            score += float(reference_logprobs(stored, cfg, h[-1])[draft_of[int(tree.tokens[n])]])
            g = torch.cat([g, h[-1:]])  # a drafted position feeds back the head's own output
            toks = torch.cat([toks, tree.tokens[n].view(1)])
        assert abs(score - float(tree.scores[node])) < 1e-4, f"node {node} path {path}"


def test_sampling_is_lossless(deep, tmp_path):
    """The first two sampled tokens (the second comes from a drafted step) follow the target's joint
    distribution. The draft vocabulary holds the target's likely tokens, so drafts get accepted."""
    _, target = deep
    cfg = SamplingConfig(temperature=1.0, top_k=3)
    p = len(PROMPT)
    target.reset(64)
    out = target.forward(torch.tensor(PROMPT), torch.arange(p))
    p1 = target_probs(out.logits[-1], cfg)  # [V]
    firsts = torch.nonzero(p1).flatten().tolist()
    joint = {}
    likely = set(firsts)
    for t1 in firsts:
        target.reset(64)
        o = target.forward(torch.tensor(PROMPT + [t1]), torch.arange(p + 1))
        p2 = target_probs(o.logits[-1], cfg)
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
            likely.add(t2)
    draft_ids = torch.tensor(sorted(likely | set(range(0, 128, 16))))
    published_head(tmp_path, target, seed=4, draft_ids=draft_ids)
    head = load_head(tmp_path, target.info)
    drafter = EagleDrafter(head, target, tree_config("eagle2", TreeConfig(top_k=3, depth=2, total_tokens=7)))
    n, counts, accepted = 800, {}, 0
    stop = StopConfig(max_new_tokens=2, stop_on_eos=False)
    for seed in range(n):
        res = Engine(target, drafter, SamplingConfig(temperature=1.0, top_k=3, seed=seed)).generate(PROMPT, stop)
        key = tuple(res.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(s.accepted for s in res.stats.steps)
    assert set(counts) <= set(joint)  # nothing outside the target's support
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - q) for k, q in joint.items())
    bound = math.sqrt((len(joint) * math.log(2) + math.log(1e6)) / (2 * n))  # fails with prob. < 1e-6
    assert tv < bound, (tv, bound)
    assert accepted > n // 10  # the drafted tokens really took part


# -- layer ids ------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["top", "eagle_config"])
@pytest.mark.parametrize("convention, ids", [(None, [1, 3, 6]), ("input", [1, 3, 6]), ("output", [0, 2, 5])])
def test_explicit_layer_ids_in_both_conventions(deep, tmp_path, where, convention, ids):
    """[1, 3, 6] as inputs of layers (EAGLE, vLLM; our default) and [0, 2, 5] as outputs of layers
    (SGLang, SpecForge) name the same residual streams: HF hidden_states 1, 3 and 6."""
    folder, target = deep
    extra = {"eagle_aux_hidden_state_layer_ids": ids} if where == "top" else \
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    if convention:
        extra["ddspec_layer_ids_convention"] = convention
    stored = published_head(tmp_path, target, seed=5, config_extra=extra)
    head = load_head(tmp_path, target.info)
    assert head.hidden_layers == (1, 3, 6)
    # the features the drafter feeds the head are fc of exactly those streams (HF's own)
    drafter = EagleDrafter(head, target, tree_config("eagle2", SMALL))
    target.reset(64)
    out = target.forward(torch.tensor(PROMPT), torch.arange(len(PROMPT)), None, drafter.hidden_layers)
    want = hf_captured(folder, PROMPT, (1, 3, 6)) @ stored["fc.weight"].T
    # fp32 rounding of an 8-layer forward, relative to its scale (a wrong stream is off by O(1)):
    # against an fp64 forward our kernels measure 1-5e-5 at |h| ~ 13 (before and after the attention rework)
    assert torch.allclose(drafter._committed_features(out), want, atol=2e-6 * want.abs().max())
    # the caller may also say which convention a config's ids use
    other = "input" if convention == "output" else "output"
    flipped = load_head(tmp_path, target.info, layer_ids_convention=other)
    assert flipped.hidden_layers == ((0, 2, 5) if other == "input" else (2, 4, 7))


# -- bad checkpoints ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"drop": ("d2t",)}, "lack d2t"),
    ({"drop": ("t2d",)}, "lack t2d"),
    ({"drop": ("d2t", "t2d")}, "lack d2t and t2d"),
    ({"fc_width": 2 * 64}, r"fc.weight has shape \[64, 128\]: its input width must be 3 x the target's hidden size \(192\)"),
    ({"config_extra": {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}}, r"reads target layers \[2, 4, 8\].* has 8 layers"),
    ({"config_extra": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 7]},
                       "ddspec_layer_ids_convention": "output"}}, r"reads target layers \[3, 5, 8\].* has 8 layers"),
    ({"config_extra": {"draft_vocab_size": 200}}, r"draft vocabulary \(draft_vocab_size 200\) is larger than the target's vocabulary \(128\)"),
    ({"draft_ids": torch.arange(128)}, None),  # the whole vocabulary as draft vocabulary is fine
    ({"config_extra": {"target_hidden_size": 32}}, "target_hidden_size 32"),
    ({"config_extra": {"ddspec_layer_ids_convention": "middle", "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}},
     "ddspec_layer_ids_convention"),
    ({"config_extra": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "reads 2 target layers"),
])
def test_bad_checkpoints_name_the_problem(deep, tmp_path, kwargs, match):
    _, target = deep
    published_head(tmp_path, target, seed=6, **kwargs)
    if match is None:
        assert isinstance(load_head(tmp_path, target.info), Eagle3Head)
        return
    with pytest.raises(ModelLoadError, match=match) as e:
        load_head(tmp_path, target.info)
    assert isinstance(e.value, DdspecError) and "EAGLE-3 head" in str(e.value)


def test_a_draft_vocabulary_larger_than_the_targets_in_the_weights(deep, tmp_path):
    _, target = deep
    published_head(tmp_path, target, seed=7)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("draft_vocab_size")  # only the weights say it: lm_head has more rows than the target has tokens
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    t = load_file(tmp_path / "model.safetensors")
    t["lm_head.weight"] = torch.zeros(130, 64, dtype=t["lm_head.weight"].dtype)
    t["d2t"] = torch.zeros(130, dtype=torch.long)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"draft vocabulary \(130 rows of lm_head.weight\) is larger"):
        load_head(tmp_path, target.info)


def test_the_cli_reports_a_bad_eagle3_head_without_a_traceback(deep, tmp_path, capsys):
    from ddspec.cli import main

    folder, target = deep
    published_head(tmp_path / "head", target, seed=8, drop=("t2d",))
    code = main(["generate", "--model", str(folder), "--head", str(tmp_path / "head"), "--method", "eagle2",
                 "--max-new-tokens", "2", "hello"])
    err = capsys.readouterr().err
    assert code == 2 and "lack t2d" in err and "Traceback" not in err


# -- export ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [DEFAULT_LAYERS, (1, 3, 6)])
def test_export_round_trip(deep, tmp_path, layers):
    _, target = deep
    extra = {} if layers == DEFAULT_LAYERS else {"eagle_aux_hidden_state_layer_ids": list(layers)}
    published_head(tmp_path / "src", target, seed=9, dtype=torch.float16, config_extra=extra)
    head = load_head(tmp_path / "src", target.info)
    save_eagle3_head(head, tmp_path / "out", LAYERS)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == head.d2t.numel() and cfg["target_hidden_size"] == 64
    assert "rope_theta" not in cfg  # the head keeps its own RoPE default, as published
    if layers == DEFAULT_LAYERS:  # both engines default to 2, L // 2, L - 3: nothing to write
        assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_config" not in cfg
    else:  # vLLM reads the top level as inputs of layers, SGLang eagle_config as outputs
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in keys and "fc.weight" in keys and {"d2t", "t2d"} <= keys
    back = load_head(tmp_path / "out", target.info)
    assert back.hidden_layers == layers
    for name, value in head.state_dict().items():  # fp16 in, fp16 out: identical
        assert torch.equal(back.state_dict()[name], value), name


def test_train_export_format_eagle3_round_trip_and_refusals(deep, tmp_path, capsys):
    """`ddspec train export --format eagle3` writes an EAGLE-3 head in RUN/head in the published layout,
    and refuses to turn an EAGLE-1/2 head into one (the maths differs) or to write an EAGLE-3 head as EAGLE-1/2."""
    from ddspec.cli import main
    from ddspec.draft.checkpoint import random_head, save_head

    folder, target = deep
    run = tmp_path / "run"
    published_head(run / "head", target, seed=10, dtype=torch.float16)
    head = load_head(run / "head", target.info)
    base = ["train", "export", "--model", str(folder), "--out", str(run), "--threads", "1"]
    assert main(base + ["--format", "eagle3", "--to", str(tmp_path / "e3")]) == 0
    back = load_head(tmp_path / "e3", target.info)
    assert isinstance(back, Eagle3Head)
    for name, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    assert main(base + ["--to", str(tmp_path / "own")]) == 0  # no --format: the head's own layout
    assert isinstance(load_head(tmp_path / "own", target.info), Eagle3Head)
    capsys.readouterr()
    assert main(base + ["--format", "eagle", "--to", str(tmp_path / "e12")]) == 2
    assert "--format eagle3" in capsys.readouterr().err
    run2 = tmp_path / "run2"
    save_head(random_head(target.hf_config), run2 / "head")
    base2 = ["train", "export", "--model", str(folder), "--out", str(run2), "--threads", "1"]
    assert main(base2 + ["--format", "eagle3", "--to", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written in the EAGLE-3 layout" in err and "Traceback" not in err
    assert not (tmp_path / "x" / "config.json").exists()

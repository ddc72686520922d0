"""Draft head checkpoints: round trip, the public EAGLE-1/2 layout, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from ddspec.draft.checkpoint import head_config_for, load_head, random_head, save_head
from ddspec.errors import ModelLoadError


def head_output(head, target):
    gen = torch.Generator().manual_seed(0)
    h = target.info.hidden_size
    feats = torch.randn(1, 6, h, generator=gen)
    toks = torch.randint(0, target.info.vocab_size, (6,), generator=gen)
    with torch.no_grad():
        return head(target.embed(toks).view(1, 6, -1), feats, torch.arange(6))


def test_round_trip_gives_same_outputs(tiny_targets, tmp_path):
    target = tiny_targets[("qwen2", "native")]
    head = random_head(target.hf_config, seed=3)
    save_head(head, tmp_path / "h", metadata={"note": "test"})
    loaded = load_head(tmp_path / "h", target.info)
    assert torch.equal(head_output(head, target), head_output(loaded, target))
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["ddspec"] == {"note": "test"}


def eagle_layout_tensors(cfg: dict, with_embed: bool, with_bias: bool) -> dict[str, torch.Tensor]:
    """Keys exactly as in the public EAGLE-1/2 checkpoints (e.g. yuhuili/EAGLE-Vicuna-7B-v1.3)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nh
    t = {
        "fc.weight": torch.randn(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": torch.randn(nh * d, h),
        "layers.0.self_attn.k_proj.weight": torch.randn(nkv * d, h),
        "layers.0.self_attn.v_proj.weight": torch.randn(nkv * d, h),
        "layers.0.self_attn.o_proj.weight": torch.randn(h, nh * d),
        "layers.0.mlp.gate_proj.weight": torch.randn(i, h),
        "layers.0.mlp.up_proj.weight": torch.randn(i, h),
        "layers.0.mlp.down_proj.weight": torch.randn(h, i),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    if with_bias:
        t["fc.bias"] = torch.randn(h)
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(cfg["vocab_size"], h)
    return t


@pytest.mark.parametrize("with_embed, with_bias, fmt", [(True, True, "bin"), (False, False, "safetensors")])
def test_public_eagle_layout_loads(tiny_targets, tmp_path, with_embed, with_bias, fmt):
    target = tiny_targets[("llama", "native")]
    cfg = {k: v for k, v in target.hf_config.items() if k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
        "rms_norm_eps", "max_position_embeddings", "model_type")}
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    if not with_bias:
        cfg["bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = eagle_layout_tensors(cfg, with_embed, with_bias)
    if fmt == "bin":
        torch.save(tensors, tmp_path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp_path / "model.safetensors"))
    head = load_head(tmp_path, target.info)
    assert hasattr(head, "embed_tokens") == with_embed
    assert (head.fc.bias is not None) == with_bias
    assert torch.equal(head.layers[0].mlp.up_proj.weight, tensors["layers.0.mlp.up_proj.weight"])


def test_missing_and_unexpected_tensors_are_listed(tiny_targets, tmp_path):
    target = tiny_targets[("llama", "native")]
    head = random_head(target.hf_config)
    save_head(head, tmp_path)
    from safetensors.torch import load_file, save_file

    t = load_file(tmp_path / "model.safetensors")
    del t["layers.0.mlp.up_proj.weight"]
    t["layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_head(tmp_path, target.info)
    assert "layers.0.mlp.up_proj.weight" in str(err.value) and "layers.0.input_layernorm.weight" in str(err.value)


def test_mismatched_head_names_both_values(tiny_targets, tmp_path):
    target = tiny_targets[("llama", "native")]
    cfg = head_config_for(target.hf_config)
    save_head(random_head({**target.hf_config, "hidden_size": 32, "intermediate_size": 64}), tmp_path)
    with pytest.raises(ModelLoadError, match="hidden_size = 32.*hidden_size = 64"):
        load_head(tmp_path, target.info)
    assert cfg["hidden_size"] == 64


def test_unreadable_and_eagle3_heads(tiny_targets, tmp_path):
    target = tiny_targets[("llama", "native")]
    with pytest.raises(ModelLoadError, match="not found"):
        load_head(tmp_path / "nope", target.info)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_head(tmp_path, target.info)
    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab_size": 32, "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="EAGLE-3"):
        load_head(tmp_path, target.info)
    (tmp_path / "config.json").write_text(json.dumps(head_config_for(target.hf_config)))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_head(tmp_path, target.info)

"""Reading and writing draft heads in the public EAGLE-1/2 layout (docs/design.md §5); EAGLE-3 heads
are told apart by their config and read by ddspec.draft.eagle3_checkpoint.

A head folder holds ``config.json`` (Llama-style, ``num_hidden_layers`` (1 in the public heads), optional ``bias``)
and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight`` [H, 2H] (+ ``fc.bias``),
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight`` and
``layers.0.post_attention_layernorm.weight``; ``embed_tokens.weight`` is optional (else the
target's is used). A head of more layers adds ``layers.i.*`` for each, with
``layers.i.input_layernorm.weight`` (the EAGLE repository's draft model does the same). Our heads may add a ``d2t`` tensor (reduced draft vocabulary) and keep
their provenance under the config key ``"ddspec"``; other engines ignore both.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddspec.draft.head import EagleHead
from ddspec.models.llama import HEAD_FAMILIES, head_arch
from ddspec.errors import ModelLoadError
from ddspec.models.base import ModelInfo

OPTIONAL_KEYS = {"embed_tokens.weight", "d2t", "t2d", "fc.bias"}
IGNORED_KEYS = {"t2d"}


def head_config_for(target_config: dict, *, bias: bool = True, layers: int = 1, ffn: int = 0) -> dict:
    """A head config.json for a target (its family's hyper-parameters, ``layers`` decoder layers;
    ``ffn`` > 0: that MLP width instead of the target's)."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings",
            "vocab_size", "attention_bias", "hidden_act", "model_type")
    cfg = {k: target_config[k] for k in keep if k in target_config}
    if cfg.get("model_type", "llama") not in HEAD_FAMILIES:  # Llama layers for any other family's target
        cfg.update(model_type="llama", hidden_act="silu", rope_parameters=head_arch(target_config, layers).rope_parameters())
        cfg.pop("rope_scaling", None)
    family = cfg.get("model_type", "llama")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    cfg.update(num_hidden_layers=layers, bias=bias, architectures=[arch.get(family, "LlamaForCausalLM")])
    if ffn:
        cfg["intermediate_size"] = int(ffn)
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    st, bin_ = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(st)
        if bin_.is_file():
            return torch.load(bin_, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
        raise ModelLoadError(f"cannot read the head weights in {folder}: {type(e).__name__}: {e}") from e
    raise ModelLoadError(f"no head weights in {folder}: expected model.safetensors or pytorch_model.bin")


def _check_compatible(cfg: dict, target: ModelInfo, folder: Path) -> None:
    n_layers = cfg.get("num_hidden_layers", 1)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or not 1 <= n_layers <= 8:
        raise ModelLoadError(f"{folder}: num_hidden_layers must be a whole number from 1 to 8 for a draft head, "
                             f"this config says {n_layers!r}")
    for key, mine in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in cfg and cfg[key] != mine:
            raise ModelLoadError(
                f"head {folder} does not fit target {target.name}: head {key} = {cfg[key]}, target {key} = {mine}"
            )
    family = cfg.get("model_type", "llama")
    if family not in ("llama", "qwen2", "mistral"):
        raise ModelLoadError(f"head {folder} is of architecture {family!r}; supported: llama, qwen2, mistral")


def load_head(folder: str | Path, target: ModelInfo, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, layer_ids_convention: str | None = None):
    """An EagleHead (EAGLE-1/2 layout) or an Eagle3Head (EAGLE-3 layout, told apart by its config;
    ``layer_ids_convention``: see ddspec.draft.eagle3_checkpoint)."""
    from ddspec.draft.eagle3_checkpoint import is_eagle3_config, load_eagle3_head

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelLoadError(f"head folder not found: {folder}")
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{folder / 'config.json'} is not a JSON object")
    if is_eagle3_config(cfg):
        return load_eagle3_head(folder, cfg, lambda: _read_tensors(folder), target, device, dtype, layer_ids_convention)
    _check_compatible(cfg, target, folder)
    tensors = _read_tensors(folder)
    for k in IGNORED_KEYS:
        tensors.pop(k, None)
    if cfg.get("bias") is None:  # EAGLE configs without the key: infer from the weights
        cfg["bias"] = "fc.bias" in tensors
    d2t = tensors.get("d2t")
    head = EagleHead(cfg, own_embedding="embed_tokens.weight" in tensors,
                     draft_vocab=None if d2t is None else d2t.numel())
    expected = set(head.state_dict())
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"head checkpoint {folder} does not match the EAGLE-1/2 layout: "
            f"missing tensors {missing or 'none'}; unexpected tensors {unexpected or 'none'}"
        )
    for name, value in head.state_dict().items():
        if tensors[name].shape != value.shape:
            raise ModelLoadError(
                f"head tensor {name} in {folder} has shape {list(tensors[name].shape)}, "
                f"expected {list(value.shape)} for this config"
            )
    head.load_state_dict(tensors)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_head(head: EagleHead, folder: str | Path, metadata: dict | None = None) -> Path:
    """Write config.json + model.safetensors (EAGLE-1/2 layout) into ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(head.config)
    cfg["bias"] = head.fc.bias is not None
    if metadata:
        cfg["ddspec"] = metadata
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def random_head(target_config: dict, seed: int = 0, std: float = 0.02,
                fuse_layers: tuple[int, ...] = (), layers: int = 1, ffn: int = 0) -> EagleHead:
    """A randomly initialised head for a target (tests, and a starting point for training); a fusion
    of target layers (``fuse_layers``) starts at zero; ``ffn`` > 0: a narrower (or wider) MLP than
    the target's layers have."""
    torch.manual_seed(seed)
    cfg = head_config_for(target_config, layers=layers, ffn=ffn)
    if fuse_layers:
        cfg["fuse_layers"] = list(fuse_layers)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name == "fuse.weight":
                continue
            if p.dim() == 2:
                p.normal_(0.0, std)
            elif name.endswith("bias"):
                p.zero_()
    return head


def add_identity_layers(head: EagleHead, earlier: EagleHead) -> None:
    """Warm start a deeper ``head`` from a shallower ``earlier`` one: copy every weight ``earlier``
    has, and zero the output projections (``o_proj``, ``down_proj``) of the layers it lacks, so the
    new layers start as the identity and ``head`` computes exactly what ``earlier`` does."""
    with torch.no_grad():
        for i in range(len(earlier.layers), len(head.layers)):
            head.layers[i].self_attn.o_proj.weight.zero_()
            head.layers[i].mlp.down_proj.weight.zero_()

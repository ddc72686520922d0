"""Reading and writing EAGLE-3 heads in the published layout (docs/design.md §5).

A head folder holds ``config.json`` (Llama-style, ``num_hidden_layers`` 1, ``draft_vocab_size``,
``architectures`` ``LlamaForCausalLM`` (the EAGLE authors') or ``LlamaForCausalLMEagle3``
(SpecForge, SGLang), optional ``target_hidden_size``) and ``model.safetensors`` or
``pytorch_model.bin`` (fp16, bf16 or fp32; converted to the target's dtype) with ``fc.weight``
[H, 3H], ``midlayer.*`` (vLLM's copies say ``layers.0.*``: both load), ``norm.weight``,
``lm_head.weight`` [draft vocab, H], ``d2t`` and ``t2d``; ``embed_tokens.weight`` is optional.

**Captured layers.** Without explicit ids the head reads the residual streams entering target
layers 2, L // 2 and L - 3 (HF ``hidden_states`` indices; every engine agrees on this default).
Explicit ids sit in ``eagle_aux_hidden_state_layer_ids``, at the top level (read first; vLLM reads
it there) or under ``eagle_config`` (SGLang reads it there), and engines count them differently:
vLLM and the EAGLE repository mean the *input* of layer j (HF index j), SGLang and SpecForge the
*output* of layer j (HF index j + 1). ddspec assumes the EAGLE repository's reading, ``"input"``,
unless the config key ``ddspec_layer_ids_convention`` says ``"output"``, or the caller passes
``layer_ids_convention`` to :func:`ddspec.draft.checkpoint.load_head`.

**Export** (:func:`save_eagle3_head`): with the default layers no ids are written (vLLM and SGLang
then both capture 2, L // 2, L - 3). Other layers are written twice, each in the convention of the
engine that reads that place: top-level ids as inputs (vLLM), ``eagle_config`` ids as outputs
(SGLang), plus ``ddspec_layer_ids_convention: "input"`` for the top-level ones we read back.
Keys vLLM reads: ``architectures``, ``hidden_size``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
``rope_theta``/``rope_scaling``, ``max_position_embeddings``, ``vocab_size``,
``draft_vocab_size``, ``target_hidden_size``, ``hidden_act``, ``num_hidden_layers``,
``eagle_aux_hidden_state_layer_ids``; SGLang reads the same Llama keys, ``draft_vocab_size``,
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddspec.draft.eagle3 import ARCHITECTURES, Eagle3Head, default_capture_layers
from ddspec.errors import DdspecError, ModelLoadError
from ddspec.models.base import ModelInfo

REQUIRED_BUFFERS = ("d2t", "t2d")
CONVENTIONS = ("input", "output")


def is_eagle3_config(cfg: dict) -> bool:
    """An EAGLE-3 head config: it names a draft vocabulary or an EAGLE-3 architecture."""
    archs = cfg.get("architectures") or [""]
    return "draft_vocab_size" in cfg or str(archs[0]).endswith("Eagle3")


def capture_layers_from_config(cfg: dict, num_layers: int, convention: str | None = None) -> tuple[int, ...]:
    """HF hidden_states indices of the target layers the head reads (see the module docstring)."""
    eagle_config = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_capture_layers(num_layers)
    convention = convention or cfg.get("ddspec_layer_ids_convention", "input")
    if convention not in CONVENTIONS:
        raise ModelLoadError(f"ddspec_layer_ids_convention must be one of {', '.join(CONVENTIONS)}, "
                             f"not {convention!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f"eagle_aux_hidden_state_layer_ids must be whole numbers, this config says {ids!r}")
    return tuple(i + (convention == "output") for i in ids)


def _fail(folder: Path, msg: str) -> ModelLoadError:
    return ModelLoadError(f"EAGLE-3 head {folder}: {msg}")


def _check_config(cfg: dict, target: ModelInfo, folder: Path) -> None:
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise _fail(folder, f"architecture {arch!r} is not one ddspec loads ({', '.join(ARCHITECTURES)})")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise _fail(folder, f"num_hidden_layers is {cfg.get('num_hidden_layers')!r}; EAGLE-3 heads have 1")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in cfg:
            raise _fail(folder, f"config.json lacks {key!r}")
    if cfg["hidden_size"] != target.hidden_size:
        raise _fail(folder, f"hidden_size {cfg['hidden_size']} differs from the target's {target.hidden_size}; "
                            "pass the head made for this target")
    if cfg.get("target_hidden_size", target.hidden_size) != target.hidden_size:
        raise _fail(folder, f"target_hidden_size {cfg['target_hidden_size']} differs from the target's hidden size "
                            f"{target.hidden_size}: this head was trained for another model")
    if cfg["vocab_size"] != target.vocab_size:
        raise _fail(folder, f"vocab_size {cfg['vocab_size']} differs from the target's {target.vocab_size}")
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 1:
        raise _fail(folder, f"draft_vocab_size must be a positive whole number, this config says {draft_vocab!r}")
    if draft_vocab > target.vocab_size:
        raise _fail(folder, f"its draft vocabulary (draft_vocab_size {draft_vocab}) is larger than the target's "
                            f"vocabulary ({target.vocab_size}): this head was made for another model")
    rope = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise _fail(folder, f"RoPE scaling {kind!r} is not supported (default and llama3 are)")


def _check_layers(layers: tuple[int, ...], target: ModelInfo, folder: Path) -> None:
    if len(layers) != 3:
        raise _fail(folder, f"it reads {len(layers)} target layers {list(layers)}; EAGLE-3 reads 3")
    bad = [i for i in layers if not 0 <= i < target.num_layers]
    if bad:
        raise _fail(folder, f"it reads target layers {list(layers)} (HF hidden_states indices: inputs of layers), "
                            f"but {target.name or 'the target'} has {target.num_layers} layers (indices 0.."
                            f"{target.num_layers - 1}): the head was made for a deeper model, or its "
                            "eagle_aux_hidden_state_layer_ids count layer outputs (set "
                            '"ddspec_layer_ids_convention": "output" in its config.json)')


def _canonical(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's ``layers.0.`` -> the published ``midlayer.``."""
    return {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
            for k, v in tensors.items()}


def _check_tensors(head: Eagle3Head, tensors: dict[str, torch.Tensor], target: ModelInfo, folder: Path) -> None:
    missing_buffers = [k for k in REQUIRED_BUFFERS if k not in tensors]
    if missing_buffers:
        raise _fail(folder, f"the weights lack {' and '.join(missing_buffers)} (the draft-to-target vocabulary maps "
                            "d2t [draft vocab] int64 and t2d [vocab] bool); re-export the head with them")
    fc = tensors.get("fc.weight")
    h = target.hidden_size
    if fc is not None and (fc.dim() != 2 or fc.shape[1] != 3 * h):
        raise _fail(folder, f"fc.weight has shape {list(fc.shape)}: its input width must be 3 x the target's "
                            f"hidden size ({3 * h}), one hidden state per captured layer")
    lm = tensors.get("lm_head.weight")
    if lm is not None and lm.shape[0] > target.vocab_size:
        raise _fail(folder, f"its draft vocabulary ({lm.shape[0]} rows of lm_head.weight) is larger than the "
                            f"target's vocabulary ({target.vocab_size})")
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise _fail(folder, f"does not match the EAGLE-3 layout: missing tensors {missing or 'none'}; "
                            f"unexpected tensors {unexpected or 'none'}")
    for name, value in expected.items():
        if tensors[name].shape != value.shape:
            raise _fail(folder, f"tensor {name} has shape {list(tensors[name].shape)}, expected {list(value.shape)} "
                                "for this config")
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    if ids.min() < 0 or ids.max() >= target.vocab_size:
        raise _fail(folder, f"d2t maps draft ids outside the target's vocabulary (0..{target.vocab_size - 1})")


def load_eagle3_head(folder: Path, cfg: dict, read_tensors, target: ModelInfo,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     layer_ids_convention: str | None = None) -> Eagle3Head:
    """An :class:`Eagle3Head` from a parsed config and its tensors (``read_tensors()``, read once the
    config has passed), checked against the target."""
    _check_config(cfg, target, folder)
    try:
        layers = capture_layers_from_config(cfg, target.num_layers, layer_ids_convention)
    except ModelLoadError as e:
        raise _fail(folder, str(e)) from None
    _check_layers(layers, target, folder)
    tensors = _canonical(read_tensors())
    head = Eagle3Head(cfg, layers, own_embedding="embed_tokens.weight" in tensors, max_position=target.max_position)
    _check_tensors(head, tensors, target, folder)
    tensors = {k: v.to(torch.long if k == "d2t" else torch.bool if k == "t2d" else torch.float32)
               for k, v in tensors.items()}
    head.load_state_dict(tensors)
    head = head.to(device=device, dtype=dtype)  # buffers keep their integer / bool dtypes
    return head.eval().requires_grad_(False)


def save_eagle3_head(head: Eagle3Head, folder: str | Path, num_target_layers: int,
                     dtype: torch.dtype = torch.float16, metadata: dict | None = None) -> Path:
    """Write config.json + model.safetensors in the published EAGLE-3 layout (``midlayer.`` keys)."""
    from safetensors.torch import save_file

    # "bias" is dropped: vLLM would read it as an attention bias (ours is attention_bias, kept)
    cfg = {k: v for k, v in head.config.items() if k not in
           ("eagle_aux_hidden_state_layer_ids", "eagle_config", "ddspec_layer_ids_convention", "ddspec", "bias")}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=head.d2t.numel(),
               target_hidden_size=head.hidden_size, torch_dtype=str(dtype).removeprefix("torch."))
    cfg.setdefault("model_type", "llama")
    cfg.setdefault("hidden_act", "silu")
    layers = list(head.capture_layers)
    if 0 in layers:
        raise DdspecError("this head reads the target's embeddings (hidden_states index 0), which SGLang's layer "
                          "ids (outputs of layers) cannot name: it cannot be exported for every engine")
    if tuple(layers) != default_capture_layers(num_target_layers):
        cfg["eagle_aux_hidden_state_layer_ids"] = layers  # vLLM: inputs of layers
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}  # SGLang: outputs
        cfg["ddspec_layer_ids_convention"] = "input"
    if metadata:
        cfg["ddspec"] = metadata
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v if k in REQUIRED_BUFFERS else v.to(dtype)).detach().to("cpu").contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder

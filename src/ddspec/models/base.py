"""The target-model interface every implementation provides.

A target runs N new tokens at given absolute positions on top of its KV cache, with an
arbitrary boolean attention mask, and returns logits and features (docs/design.md §1: the
post-final-norm hidden state, the input of the lm_head). The new tokens occupy cache slots
``[length, length + N)``; :meth:`TargetModel.commit` then keeps only the entries of an
accepted path, which is how a draft tree is rolled back to its accepted branch.

Mask convention: ``mask`` is ``None`` (every new token sees the whole prefix and the new tokens
before it: plain causal decoding), ``[N, N]`` (prefix fully visible, the new tokens see each
other as given: a tree mask), or ``[N, length + N]`` (everything explicit). True = attend.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch



@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Architecture facts a caller needs, independent of the implementation."""

    family: str  # HF model_type: llama, mistral, qwen2, ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position: int  # the context window, in tokens
    eos_token_ids: tuple[int, ...]
    name: str = ""  # where the weights came from, for messages and cache keys
    # the model's published name where the files carry one (a GGUF's general.name, a config's
    # _name_or_path), else the folder's name: how ddspec finds the draft head it ships for a model
    published: str = ""


@dataclass(slots=True)
class TargetOutput:
    logits: torch.Tensor  # [N, V] fp32 (or the model dtype); [1, V] when asked for the last token's only
    features: torch.Tensor  # [N, H] post-final-norm hidden states
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> [N, H]
    argmax: torch.Tensor | None = None  # [N] int64 each row's argmax (numpy's), when the forward took it already


@runtime_checkable
class TargetModel(Protocol):
    info: ModelInfo
    tokenizer: object  # a HF tokenizer with a chat template
    device: torch.device
    dtype: torch.dtype
    hf_config: dict  # the model's config.json

    @property
    def cache_length(self) -> int:
        """Number of committed positions in the KV cache."""

    def reset(self, max_length: int) -> None:
        """Start a new sequence with room for ``max_length`` positions."""

    def forward(
        self,
        tokens: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64 absolute positions (RoPE)
        mask: torch.Tensor | None = None,  # see module docstring
        hidden_layers: tuple[int, ...] = (),  # HF hidden_states indices: k = input of layer k
        last_logits: bool = False,  # logits of the last token only ([1, V]): a prefill needs no more
    ) -> TargetOutput:
        """Run the new tokens; their KV lands in slots [cache_length, cache_length + N)."""

    def reserve(self, max_length: int) -> None:
        """Make room for ``max_length`` positions, keeping the cached ones (prefix reuse)."""

    def commit(self, keep: torch.Tensor) -> None:
        """Keep the last forward's entries at indices ``keep`` [a] (ascending), drop the rest."""

    def truncate(self, length: int) -> None:
        """Forget every cached position from ``length`` on."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings [..., H] (shared with EAGLE heads)."""

    def lm_head(self, features: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from features (shared with EAGLE heads)."""

    def lm_head_weight_t(self) -> torch.Tensor:
        """The lm_head weight as [H, V]."""


def expand_mask(mask: torch.Tensor | None, prefix: int, n: int, device: torch.device) -> torch.Tensor | None:
    """Normalise a caller's mask to [N, prefix + N] bool, or None for plain causal decoding of 1 token."""
    if mask is None:
        if n == 1:
            return None
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
        mask = causal
    mask = mask.to(device=device, dtype=torch.bool)
    if mask.shape == (n, n):
        full = torch.ones(n, prefix + n, dtype=torch.bool, device=device)
        full[:, prefix:] = mask
        return full
    if mask.shape != (n, prefix + n):
        raise ValueError(f"mask must be [N, N] or [N, prefix + N] = [{n}, {prefix + n}], got {list(mask.shape)}")
    return mask


def masked_attention_backends(device: torch.device):
    """The context to run masked attention in on ``device``: on a GPU, torch's SDPA backends other
    than cuDNN's; elsewhere (or with ``DDSPEC_CUDNN_ATTENTION=1``) torch's own choice.

    Every tree forward and every draft level passes an attention mask. With one, torch sends bf16 /
    fp16 attention to cuDNN where it can, and cuDNN builds an execution plan for each new shape
    (FunASR measured about 1 s a plan on a B200, pull request modelscope/FunASR#3705); here the keys
    grow by a few tokens every step, so a step would pay for a plan. On one H200 (2026-12-04,
    docs/gpu-2026-12-04) EAGLE-2 / DDD / ddspec steps took 164 / 108 / 46 ms in bf16 against 29 / 26 /
    13 in fp32 (where cuDNN attention is not used) and plain decoding (no mask) was not slowed:
    this is the likely cause; the change is not yet measured on a GPU. The other backends (memory-
    efficient, flash, math) need no plans and compute the same attention."""
    if device.type != "cuda" or os.environ.get("DDSPEC_CUDNN_ATTENTION", "0").strip() in ("1", "on", "yes", "true"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

"""The EAGLE-3 draft head, in the layout the EAGLE authors, SpecForge, vLLM and SGLang publish.

At a committed position t the head reads ``g_t = fc(cat(h^a_t, h^b_t, h^c_t))`` ([3H] -> [H], no
bias), where ``h^i`` is the target's residual stream entering layer i (HF ``hidden_states[i]``),
by default layers ``2, L // 2, L - 3`` of an L-layer target. At a drafted position it reads instead
its own output at the parent (H wide, no ``fc``). One decoder layer ("midlayer") then runs on

    x = cat(input_layernorm(embed(token_{t+1})), hidden_norm(g))      # [2H], the EAGLE order
    h = g + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))        # q/k/v take 2H inputs
    h = h + mlp(post_attention_layernorm(h))

and ``h`` (pre-norm) is both what a child feeds back and, through ``lm_head(norm(h))``, the
draft's logits over its own draft vocabulary: draft id d is target id ``d + d2t[d]``. ``embed`` is
the target's unless the checkpoint carries ``embed_tokens.weight``. The head's RoPE follows its own
config (base 10000 when ``rope_theta`` is absent, as in the published Llama-3.1 head), not the
target's.

The module's parameter names are the published keys (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, buffers ``d2t`` and ``t2d``), so ``state_dict()`` is the checkpoint layout.
:meth:`Eagle3Head.forward` is written plainly: the reference that training runs and that the
drafting fast path (:class:`~ddspec.draft.packed.PackedEagle3Head`, on a CPU) is tested against.

The drafter (:class:`~ddspec.draft.eagle.EagleDrafter`) reaches both head kinds through the same
small interface: ``hidden_layers``, ``committed_features``, ``drafting_forward``,
``draft_lm_head_weight`` and ``logits_input``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ddspec.draft.head import HeadMLP, RMSNormWeight, cached_rotary
from ddspec.kv_cache import StaticKVCache
from ddspec.models.base import TargetOutput
from ddspec.models.llama import LlamaArch, Rotary, attention, head_arch, rms_norm

ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle3")


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads by default (HF ``hidden_states`` indices: inputs of layers)."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3Attention(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.q_proj = nn.Linear(2 * h, arch.num_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(2 * h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(2 * h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=False)


class Eagle3Layer(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        h = arch.hidden_size
        self.hidden_norm = RMSNormWeight(h)
        self.input_layernorm = RMSNormWeight(h)
        self.self_attn = Eagle3Attention(arch)
        self.mlp = HeadMLP(arch)
        self.post_attention_layernorm = RMSNormWeight(h)


class Eagle3Head(nn.Module):
    # its lm_head has rows for its own draft vocabulary only: other target tokens cannot be scored
    # (context_vocab.py needs the target's lm_head)
    shares_target_lm_head = False
    # how its matmul weights are held when drafting_forward() returns this module itself (off a CPU,
    # or outside fp32): as they are (packed.DRAFT_WEIGHTS' "exact"); see packed.DraftingForward
    weights = "exact"

    def __init__(self, config: dict, capture_layers: tuple[int, ...], *, own_embedding: bool = False,
                 max_position: int | None = None) -> None:
        """config: the head's config.json; capture_layers: HF hidden_states indices of the target
        layers ``fc`` reads, in order; max_position: room for the RoPE tables (the target's context)."""
        super().__init__()
        self.config = dict(config)
        self.capture_layers = tuple(int(i) for i in capture_layers)
        arch = head_arch(config, 1)
        if max_position is not None and max_position > arch.max_position:
            arch = dataclasses.replace(arch, max_position=max_position)
        self.arch = arch
        h = arch.hidden_size
        draft_vocab = int(config.get("draft_vocab_size") or arch.vocab_size)
        self.fc = nn.Linear(len(self.capture_layers) * h, h, bias=False)
        self.midlayer = Eagle3Layer(arch)
        self.norm = RMSNormWeight(h)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(arch.vocab_size, dtype=torch.bool))
        self._rotary: Rotary | None = None

    # -- properties ----------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers the drafter asks of every forward (HF hidden_states indices)."""
        return self.capture_layers

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary [Vd]."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rotary(self) -> Rotary:
        return cached_rotary(self)

    def new_cache(self, max_length: int) -> StaticKVCache:
        p, a = self.fc.weight, self.arch
        return StaticKVCache(1, a.num_kv_heads, a.head_dim, max_length, dtype=p.dtype, device=p.device)

    # -- the drafter's interface ---------------------------------------------------------
    def committed_features(self, target_out: TargetOutput, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``fc`` of the captured target states at committed positions: [n, H]."""
        states = [target_out.hidden_states[i] for i in self.capture_layers]
        if rows is not None:
            states = [s[rows] for s in states]
        return self.fc(torch.cat(states, dim=-1).to(self.fc.weight.dtype))

    def drafting_forward(self):
        """The drafter's :class:`~ddspec.draft.packed.DraftingForward`: the kernel-planned copy of this
        head on a CPU in fp32, else this module (its ``forward``, ``committed_features`` and ``weights``)."""
        p = self.fc.weight
        if p.device.type != "cpu" or p.dtype != torch.float32:
            return self
        from ddspec.draft.packed import PackedEagle3Head

        return PackedEagle3Head(self)

    def draft_lm_head_weight(self, target, draft_ids: torch.Tensor | None) -> torch.Tensor:
        """The draft logits' weight [Vd, H]: the head's own lm_head."""
        return self.lm_head.weight.detach()

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads: norm(h)."""
        return rms_norm(hidden, self.norm.weight, self.arch.rms_eps)

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        embeds: torch.Tensor,  # [B, N, H] embeddings of token_{t+1}
        features: torch.Tensor,  # [B, N, H] fc(captured states) at committed positions, else the parent's h
        positions: torch.Tensor,  # [N] or [B, N] the positions t
        mask: torch.Tensor | None = None,  # [B or 1, 1, N, T] bool; None = causal (no cache) / all (cache)
        cache: StaticKVCache | None = None,  # written at slots [length, length + N) when given
        attend=None,  # training-time test: (layer, k, v) [B, nkv, N, D] -> the keys/values to attend over
    ) -> torch.Tensor:
        """The head's pre-norm output h: [B, N, H]."""
        a, layer = self.arch, self.midlayer
        attn, mlp = layer.self_attn, layer.mlp
        if attend is not None:
            own = attend
            attend = lambda k_, v_: own(0, k_, v_)  # noqa: E731  (the caller's keys and mask)
        elif cache is None:
            n = embeds.shape[1]
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=embeds.device).tril_().view(1, 1, n, n)
            attend = lambda k_, v_: (k_, v_)  # noqa: E731
        else:
            attend = lambda k_, v_: cache.write(0, k_, v_)  # noqa: E731
        x = torch.cat([rms_norm(embeds, layer.input_layernorm.weight, a.rms_eps),
                       rms_norm(features, layer.hidden_norm.weight, a.rms_eps)], dim=-1)  # [B, N, 2H]
        h = features + attn.o_proj(attention(attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), a, self.rotary(),
                                             positions, attend, mask))
        hn = rms_norm(h, layer.post_attention_layernorm.weight, a.rms_eps)
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(hn)) * mlp.up_proj(hn))
        if cache is not None:
            cache.advance(embeds.shape[1])
        return h

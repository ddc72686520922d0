"""The EAGLE-1/2 draft head (docs/design.md §2.1).

At position t the head reads ``x = fc(cat(embed(token_{t+1}), f_t))`` and runs one decoder
layer of the target's family (without its first RMSNorm, as in the public checkpoints), giving
``f̂_{t+1}``; the target's own ``lm_head`` turns that into logits for token t+2. ``embed`` and
``lm_head`` are the target's, frozen and shared (a checkpoint may carry its own embed). A head
may stack more decoder layers (config ``num_hidden_layers``): every layer after the first has an
``input_layernorm``, as in the EAGLE repository's multi-layer draft model.

The module's parameter names are exactly the EAGLE-1/2 checkpoint keys (``fc.weight``,
``layers.0.self_attn.q_proj.weight``, ...), so ``state_dict()`` is the checkpoint layout. One
``forward`` serves training (a whole sequence, causal, no cache) and drafting (new entries
on top of the head's own KV cache, with a tree mask).

An optional reduced draft vocabulary ``d2t`` (EAGLE-3's convention: target id = draft id +
d2t[draft id]) makes drafting compute logits only over those tokens.

Fused features (optional, config key ``fuse_layers``, after EAGLE-3): at committed positions the
head's input feature becomes ``f_t + fuse(cat(norm(h^a_t), norm(h^b_t), ...))``, where ``h^i`` is
the target's residual stream at the input of layer i (HF ``hidden_states[i]``) and ``norm`` a
weightless RMS norm; ``fuse`` starts at zero, so a head warm-started from a plain one begins as
exactly that head. Draft positions (depth >= 2) still read the head's own predicted feature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddspec.draft.features import fusion_input
from ddspec.kv_cache import StaticKVCache
from ddspec.models.llama import LlamaArch, Rotary, attention, head_arch, rms_norm


def cached_rotary(head: nn.Module) -> Rotary:
    """A head's RoPE tables, built once for its weights' device and dtype (kept in ``head._rotary``)."""
    p = head.fc.weight
    if head._rotary is None or head._rotary.cos.device != p.device or head._rotary.cos.dtype != p.dtype:
        head._rotary = Rotary(head.arch, p.device, p.dtype)
    return head._rotary


class RMSNormWeight(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class HeadAttention(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=False)


class HeadMLP(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class HeadLayer(nn.Module):
    def __init__(self, arch: LlamaArch, first: bool = True) -> None:
        super().__init__()
        if not first:  # EAGLE's layout: every layer but the first normalises its input
            self.input_layernorm = RMSNormWeight(arch.hidden_size)
        self.self_attn = HeadAttention(arch)
        self.mlp = HeadMLP(arch)
        self.post_attention_layernorm = RMSNormWeight(arch.hidden_size)


class EagleHead(nn.Module):
    # its logits are the target's lm_head of f̂, so any target token can be scored (context_vocab.py)
    shares_target_lm_head = True

    def __init__(self, config: dict, *, own_embedding: bool = False, draft_vocab: int | None = None) -> None:
        super().__init__()
        self.config = dict(config)
        n_layers = int(config.get("num_hidden_layers", 1))
        self.arch = head_arch(config, n_layers)
        h = self.arch.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bool(config.get("bias", True)))
        self.layers = nn.ModuleList([HeadLayer(self.arch, first=i == 0) for i in range(n_layers)])
        if own_embedding:
            self.embed_tokens = nn.Embedding(self.arch.vocab_size, h)
        if draft_vocab is not None:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        if self.fuse_layers:
            self.fuse = nn.Linear(len(self.fuse_layers) * h, h, bias=False)
            nn.init.zeros_(self.fuse.weight)
        self._rotary: Rotary | None = None

    # -- properties ----------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def fuse_layers(self) -> tuple[int, ...]:
        """Target layers whose inputs (HF ``hidden_states`` indices) the head fuses into its feature; () = none."""
        return tuple(int(i) for i in self.config.get("fuse_layers") or ())

    def fused_features(self, features: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """Input features at committed positions: ``f_t`` plus the fused layers' term (``extra`` from
        :func:`fusion_input`, [..., n_layers * H]); ``f_t`` unchanged for a plain head."""
        if not self.fuse_layers:
            return features
        if extra is None:
            raise ValueError(f"this head fuses target layers {list(self.fuse_layers)} but got no layer states")
        return features + self.fuse(extra.to(features.dtype))

    # -- the drafter's interface (shared with ddspec.draft.eagle3.Eagle3Head) --------------
    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers the drafter asks of every forward (a fused head's; () for a plain one)."""
        return self.fuse_layers

    def committed_features(self, target_out, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input features at committed positions (``rows`` of the forward; None = all)."""
        f = target_out.features if rows is None else target_out.features[rows]
        if not self.fuse_layers:
            return f
        states = [target_out.hidden_states[i] for i in self.fuse_layers]
        extra = fusion_input(states if rows is None else [s[rows] for s in states])
        return self.fused_features(f.to(self.fc.weight.dtype), extra)

    def drafting_forward(self):
        """The callable the drafter runs for head entries: the kernel-planned copy of this head."""
        from ddspec.draft.packed import PackedHead

        return PackedHead(self)

    def draft_lm_head_weight(self, target, draft_ids: torch.Tensor | None) -> torch.Tensor:
        """The draft logits' weight [Vd, H]: the target's lm_head, restricted to the draft vocabulary."""
        lm = target.lm_head_weight_t()  # [H, V]
        return (lm if draft_ids is None else lm[:, draft_ids]).t()

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads: f̂ itself."""
        return hidden

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the reduced draft vocabulary [Vd], or None for the full vocabulary."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t

    def rotary(self) -> Rotary:
        return cached_rotary(self)

    def new_cache(self, max_length: int) -> StaticKVCache:
        p = self.fc.weight
        a = self.arch
        return StaticKVCache(len(self.layers), a.num_kv_heads, a.head_dim, max_length, dtype=p.dtype, device=p.device)

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        embeds: torch.Tensor,  # [B, N, H] embeddings of token_{t+1}
        features: torch.Tensor,  # [B, N, H] target (or predicted) features f_t
        positions: torch.Tensor,  # [N] or [B, N] the positions t
        mask: torch.Tensor | None = None,  # [B or 1, 1, N, T] bool; None = causal (no cache) / all (cache)
        cache: StaticKVCache | None = None,  # written at slots [length, length + N) when given
        attend=None,  # training-time test: (layer, k, v) [B, nkv, N, D] -> the keys/values to attend over
    ) -> torch.Tensor:
        """Predicted features f̂_{t+1}: [B, N, H]."""
        a = self.arch
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, N, H]
        if attend is not None:
            pass  # the caller's keys and mask (see ddspec.train.trainer.ttt_passes)
        elif cache is None:
            n = x.shape[1]
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril_().view(1, 1, n, n)
            attend = lambda i, k_, v_: (k_, v_)  # noqa: E731
        else:
            attend = cache.write
        rotary = self.rotary()
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            xn = x if i == 0 else rms_norm(x, layer.input_layernorm.weight, a.rms_eps)
            q, k, v = attn.q_proj(xn), attn.k_proj(xn), attn.v_proj(xn)
            x = x + attn.o_proj(attention(q, k, v, a, rotary, positions, lambda k_, v_, i=i: attend(i, k_, v_), mask))
            hn = rms_norm(x, layer.post_attention_layernorm.weight, a.rms_eps)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(hn)) * mlp.up_proj(hn))
        if cache is not None:
            cache.advance(q.shape[1])
        return x

"""A preallocated KV cache written at slots, with keep-path and truncate (docs/design.md §2.6).

Layout per layer: keys and values ``[B, H_kv, T_max, D]``, fp32, or fp16 (the 8-bit-activation
model's: see ``models.llama.kv_cache_dtype``). A forward over N new tokens writes
slots ``[length, length + N)`` and reads ``[0, length + N)``. After verification,
:meth:`StaticKVCache.keep` copies the accepted entries into contiguous slots right after the
committed prefix; everything beyond the new length is garbage the next write overwrites.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, T, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, T, D]
        self.length = 0  # committed positions
        self.pending = 0  # positions written by the last forward, not yet committed

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_length:
            raise ValueError(
                f"KV cache full: {self.length} cached + {n} new > {self.max_length} slots"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, N, D] at slots [length, length+N); return the keys/values to attend to
        (in k's dtype: a cache of fp16 rounds what it stores, and hands fp32 callers its values as fp32)."""
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        if keys.dtype != k.dtype:
            return keys.to(k.dtype), values.to(v.dtype)
        return keys, values

    def advance(self, n: int) -> None:
        """Mark n new slots as written by a forward (all layers done)."""
        self.pending = n
        self.length += n

    def keep(self, keep: torch.Tensor) -> None:
        """Keep the last forward's entries at ``keep`` [a] (indices into its N new tokens)."""
        base = self.length - self.pending
        n_keep = int(keep.numel())
        if n_keep > self.pending:
            raise ValueError(f"cannot keep {n_keep} of {self.pending} new entries")
        if keep.device.type == "cpu":  # a few indices: a host list beats two tensor ops per step
            in_place = keep.tolist() == list(range(n_keep))
        else:
            in_place = torch.equal(keep, torch.arange(n_keep, device=keep.device))
        if not in_place:  # the kept entries move down to follow the committed ones
            src = keep.to(self.keys.device) + base  # [a]
            dst = slice(base, base + n_keep)
            self.keys[:, :, :, dst] = self.keys.index_select(3, src)
            self.values[:, :, :, dst] = self.values.index_select(3, src)
        self.length = base + n_keep
        self.pending = 0

    def reserve(self, max_length: int) -> None:
        """Make room for ``max_length`` slots, keeping the committed entries (prefix reuse)."""
        if max_length <= self.max_length:
            return
        keys = self.keys.new_zeros(self.keys.shape[:3] + (max_length,) + self.keys.shape[4:])
        values = torch.zeros_like(keys)
        keys[:, :, :, : self.length] = self.keys[:, :, :, : self.length]
        values[:, :, :, : self.length] = self.values[:, :, :, : self.length]
        self.keys, self.values = keys, values

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
        self.pending = 0

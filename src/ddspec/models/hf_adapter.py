"""Any HF transformers causal LM that accepts custom 4D attention masks, as a target.

Used for every family the native implementation does not cover, and as the reference the
native implementation is tested against. Tree attention goes in as a boolean
``(1, 1, N, prefix + N)`` mask with explicit ``position_ids``; the features are the last entry
of ``hidden_states`` (post-final-norm, docs/design.md §6).
"""

from __future__ import annotations

import inspect

import torch

from ddspec.models.base import ModelInfo, TargetOutput, expand_mask, masked_attention_backends


class HFTarget:
    def __init__(self, model, info: ModelInfo, tokenizer: object = None) -> None:
        self.model = model.eval()
        self.info, self.tokenizer = info, tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.hf_config = model.config.to_dict()
        self.cache = None
        self.length = 0
        self.pending = 0
        params = inspect.signature(model.forward).parameters
        self._keeps_logits = "logits_to_keep" in params  # transformers >= 4.50
        # the KV cache's keyword: `cache` in recent transformers, `past_key_values` before (5.17 and older
        # take an unknown keyword into **kwargs without a word and keep no cache)
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        from ddspec.models.llama import layer_windows

        # sliding windows: the cache keeps every key (commit and truncate index it) and the masks hide
        # what a window hides, per layer type where only some layers have one (transformers' mask dict)
        windows = layer_windows(self.hf_config) if "num_hidden_layers" in self.hf_config else ()
        self._window = max(windows, default=0)
        self._every_layer_windowed = bool(windows) and min(windows) > 0
        # eager attention (Gemma 2's soft-capping) adds its mask to the scores: 0 / -inf, not True / False
        self._additive_masks = getattr(model.config, "_attn_implementation", None) == "eager"

    @property
    def cache_length(self) -> int:
        return self.length

    def reset(self, max_length: int) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache() if self._window else DynamicCache(config=self.model.config)
        self.length = self.pending = 0

    def reserve(self, max_length: int) -> None:
        if self.cache is None:  # a DynamicCache grows by itself
            self.reset(max_length)

    def _layers(self):
        return self.cache.layers

    def commit(self, keep: torch.Tensor) -> None:
        base = self.length - self.pending
        src = keep.to(self.device) + base
        for layer in self._layers():
            layer.keys = torch.cat([layer.keys[:, :, :base], layer.keys.index_select(2, src)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :base], layer.values.index_select(2, src)], dim=2)
        self.length = base + int(keep.numel())
        self.pending = 0

    def truncate(self, length: int) -> None:
        if length < self.length:
            for layer in self._layers():
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]
        self.length, self.pending = length, 0

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.get_input_embeddings()(tokens)
        if self.hf_config.get("model_type") in ("gemma", "gemma2"):  # scaled in the model's forward, not the module
            x = x * torch.tensor(self.hf_config["hidden_size"] ** 0.5, dtype=x.dtype)
        return x

    def lm_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(features)

    def lm_head_weight_t(self) -> torch.Tensor:
        """The lm_head as [H, V] (what drafters multiply by)."""
        return self.model.get_output_embeddings().weight.detach().t()

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        last_logits: bool = False,
    ) -> TargetOutput:
        if self.cache is None:
            raise RuntimeError("call reset(max_length) before forward")
        n = tokens.shape[-1]
        full = expand_mask(mask, self.length, n, self.device)
        if full is None:
            full = torch.ones(1, self.length + 1, dtype=torch.bool, device=self.device)
        attention_mask = full.view(1, 1, n, -1)
        if self._window:
            from ddspec.models.llama import window_mask

            local = window_mask(full, positions.to(self.device), self.length, self._window)
            local = attention_mask if local is None else local.view(1, 1, n, -1)
            attention_mask = local if self._every_layer_windowed else {"full_attention": attention_mask,
                                                                         "sliding_attention": local}
        if self._additive_masks:
            def additive(m: torch.Tensor) -> torch.Tensor:
                return torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(~m, float("-inf"))
            attention_mask = ({k: additive(v) for k, v in attention_mask.items()} if isinstance(attention_mask, dict)
                              else additive(attention_mask))
        with masked_attention_backends(self.device):  # a GPU: no cuDNN plan per shape
            out = self.model(
                input_ids=tokens.to(self.device).view(1, n),
                position_ids=positions.to(self.device).view(1, n),
                attention_mask=attention_mask,
                **{self._cache_kwarg: self.cache},
                use_cache=True,
                output_hidden_states=True,
                **({"logits_to_keep": 1} if last_logits and self._keeps_logits else {}),
            )
        self.length += n
        self.pending = n
        hs = out.hidden_states
        hidden = {i: hs[i][0] for i in hidden_layers}
        return TargetOutput(out.logits[0, -1:] if last_logits else out.logits[0], hs[-1][0], hidden)

    @torch.inference_mode()
    def forward_batch(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features [B, T, H] of right-padded sequences without touching the cache."""
        out = self.model(input_ids=tokens.to(self.device), attention_mask=attention_mask,
                         use_cache=False, output_hidden_states=True)
        return out.hidden_states[-1]

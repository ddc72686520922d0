"""Tiny random models built in code, for tests and the ``--tiny`` pipelines.

No network, no files shipped: a character-level tokenizer with a chat template, and a random
model of one of the native families (Llama, Qwen2/3, Mistral, Gemma 1/2/3, Phi-3) of a few layers saved as a normal HF folder, so that every loader and
both target implementations are exercised exactly as with a real model.
"""

from __future__ import annotations

import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def tiny_tokenizer(vocab_size: int = 128):
    """A character-level fast tokenizer: specials, then printable ASCII, padded to vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    if len(vocab) > vocab_size:
        raise ValueError(f"vocab_size must be >= {len(vocab)} for the tiny tokenizer")
    for i in range(len(vocab), vocab_size):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "phi3")


def tiny_config(family: str = "llama", vocab_size: int = 128, hidden: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 128, max_position: int = 512,
                sliding_window: int | None = None):
    """A tiny config of one family (FAMILIES). sliding_window: the window of the layers that have
    one (Mistral, Phi-3: all; Gemma 2: every other one; Gemma 3: five in six), or None for none
    (Gemma: the window is then longer than max_position)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_position, rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=None,
        pad_token_id=0,
    )
    gemma_window = sliding_window or 2 * max_position
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if family == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=sliding_window)
    if family == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=True, head_dim=hidden // heads)
    if family == "gemma":
        return GemmaConfig(**common, head_dim=hidden // heads)
    if family == "gemma2":
        return Gemma2Config(**common, head_dim=hidden // heads, sliding_window=gemma_window,
                            query_pre_attn_scalar=hidden // heads * 2, attn_logit_softcapping=5.0,
                            final_logit_softcapping=3.0)
    if family == "gemma3":
        return Gemma3TextConfig(**common, head_dim=hidden // heads, sliding_window=gemma_window,
                                query_pre_attn_scalar=hidden // heads * 2,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                    "rope_theta": 1000000.0}})
    if family == "phi3":
        return Phi3Config(**common, tie_word_embeddings=False, sliding_window=sliding_window,
                          original_max_position_embeddings=max_position)
    raise ValueError(f"unknown tiny family {family!r}: choose one of {', '.join(FAMILIES)}")


def make_tiny_model_dir(path: str | Path, family: str = "llama", seed: int = 0, **kwargs) -> Path:
    """Save a random tiny model + tokenizer as a HF folder at ``path`` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    cfg = tiny_config(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, less tie-prone distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif p.dim() == 1 and family != "llama":  # biases, norms (Gemma's 1 + w with w = 0 by default)
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    tiny_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path

"""Chat templating: turning a conversation into prompt token ids."""

from __future__ import annotations

from ddspec.errors import DdspecError


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if len(messages) == 1 and messages[0]["role"] == "user":  # base models: plain continuation
        return tokenizer.encode(messages[0]["content"])
    raise DdspecError("this model's tokenizer has no chat template, so multi-turn chat is unavailable")

"""Chat templating: turning a conversation into prompt token ids.

Message contents are text, never control: by default a special token typed in a message
(``<|im_end|>``, ``<|im_start|>system``) is tokenized as the characters it is made of, so
a user cannot close their own turn and forge another role's. Only the template's own markup
becomes special tokens. ``special_tokens=True`` restores the plain behaviour (the rendered
text tokenized as a whole, typed special tokens included), for callers that put control
tokens in contents on purpose (``ddspec serve --allow-special-tokens``).
"""

from __future__ import annotations

from ddspec.errors import DdspecError

# stands in for each message's content while the template renders; no template or text holds it
_MARK = "\x00ddspec-content-{}\x00"


def special_texts(tokenizer) -> list[str]:
    """The texts the tokenizer turns into special (added, control) tokens."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok))
    return sorted(t for t in texts if t)


def _literal(tokenizer, text: str) -> list[int]:
    """``text`` as plain text: a special token's spelling becomes ordinary tokens."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], special_tokens: bool = False) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the assistant's turn.

    special_tokens: let a special token typed in a content be that control token (default: it is
    tokenized as text). Contents without any special token's spelling get the same ids either way.
    """
    specials = [] if special_tokens else special_texts(tokenizer)
    typed = any(s in m["content"] for m in messages for s in specials)
    if getattr(tokenizer, "chat_template", None):
        if not typed:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return tokenizer.encode(text, add_special_tokens=False)
        return _templated_literal(tokenizer, messages)
    if len(messages) == 1 and messages[0]["role"] == "user":  # base models: plain continuation
        content = messages[0]["content"]
        if not typed:
            return tokenizer.encode(content)
        # the tokenizer's own framing (a BOS, say) around the content, the content as text
        framing = tokenizer.encode("")
        return framing + _literal(tokenizer, content) if framing else _literal(tokenizer, content)
    raise DdspecError("this model's tokenizer has no chat template, so multi-turn chat is unavailable")


def _templated_literal(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The template rendered around markers, its markup tokenized with special tokens and each
    content as plain text in its place."""
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    for i, m in enumerate(messages):
        mark = _MARK.format(i)
        before, found, text = text.partition(mark)
        if not found or mark in text:
            raise DdspecError("this model's chat template rewrites message contents, so a content holding a special "
                              "token's text cannot be kept as text: remove the special token from the message (or "
                              "start the server with --allow-special-tokens)")
        if before:
            ids += tokenizer.encode(before, add_special_tokens=False)
        ids += _literal(tokenizer, m["content"])
    if text:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids

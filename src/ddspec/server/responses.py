"""The OpenAI response objects: whole answers, SSE chunks, usage (with ddspec's own numbers) and
the page's per-step trace."""

from __future__ import annotations

import json
import time
import uuid

from ddspec.engine import Chunk, RunStats
from ddspec.server.protocol import Request

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length"}  # engine -> OpenAI finish_reason


def usage(stats: RunStats, completion_tokens: int, method: str) -> dict:
    n = len(stats.steps)
    draft = sum(s.draft_ms for s in stats.steps)
    verify = sum(s.verify_ms for s in stats.steps)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": stats.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
        "ddspec": {
            "method": method,
            "tau": round(stats.tau, 4),
            "steps": n,
            "draft_ms": round(draft, 2),
            "verify_ms": round(verify, 2),
            "mean_tree_size": round(sum(s.tree_size for s in stats.steps) / n, 2) if n else 0.0,
            "prefill_ms": round(stats.prefill_s * 1e3, 2),
            "reused_prompt_tokens": stats.reused_tokens,
            "wall_ms": round(stats.wall_s * 1e3, 2),
            "tokens_per_s": round(stats.tokens_per_s, 2),
        },
    }


def trace_of(chunk: Chunk, tokenizer) -> dict:
    """The page's view of a chunk: its token count, the step's stats, and its tree with token texts."""
    out: dict = {"new_tokens": len(chunk.token_ids)}
    if chunk.step is not None:
        s = chunk.step
        out["step"] = {"accepted": s.accepted, "tree_size": s.tree_size, "depth": s.depth,
                       "draft_ms": round(s.draft_ms, 2), "verify_ms": round(s.verify_ms, 2)}
    if chunk.tree is not None:
        t = chunk.tree
        tree = {"tokens": t.tokens, "texts": [tokenizer.decode([i]) for i in t.tokens], "parents": t.parents,
                "scores": [round(x, 3) for x in t.scores], "path": t.path}
        if len(chunk.token_ids) == len(t.path):  # not cut by a stop: the last token is the bonus
            tree["bonus_text"] = tokenizer.decode([chunk.token_ids[-1]])
        out["tree"] = tree
    return out


class Answer:
    """Builds the OpenAI objects of one request, streaming or whole."""

    def __init__(self, req: Request, model: str, method: str) -> None:
        self.req, self.model, self.method = req, model, method
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _frame(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False, extra: dict | None = None) -> dict:
        more = {"ddspec": extra} if extra else {}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._frame("chat.completion.chunk", [choice], **more)
        return self._frame("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                "finish_reason": finish}], **more)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._frame("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage_)

    def whole(self, text: str, finish: str, usage_: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish}
            return self._frame("chat.completion", [choice], usage=usage_)
        return self._frame("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish}], usage=usage_)


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()

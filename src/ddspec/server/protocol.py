"""The OpenAI request shapes ddspec accepts, checked into one :class:`Request` per call.

What a body may hold, in order of the checks:

1. JSON that is an object (else 400), of at most ``max_body_bytes`` (else 413, checked by the app),
   whose strings (keys included) are valid Unicode: a lone UTF-16 surrogate (``"\\ud800"``) cannot be
   tokenized or written back, so it is a 400 that names where it is.
2. No parameter we cannot honour: ``n`` > 1, ``logprobs``, ``top_logprobs``, tools and functions,
   a non-text ``response_format``, ``logit_bias``, penalties, ``best_of``, ``echo``, ``suffix``,
   audio: one 400 that names every one of them. Names we do not know at all also get a 400.
3. Types and ranges (pydantic, strict: ``"0.5"`` is not a number): 400 with every bad field (the
   OpenAI API answers 400 to every invalid request; its clients map 422 to another exception).

Errors are :class:`ApiError`, rendered as OpenAI renders them:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddspec.config import SamplingConfig
from ddspec.errors import ConfigError
from ddspec.methods import split_method


class ApiError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- what we cannot do: each test is true when the value asks for something unsupported -------
def _truthy(v) -> bool:
    return v not in (None, False, 0, "", [], {})


UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": _truthy,
    "top_logprobs": _truthy,
    "tools": _truthy,
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": _truthy,
    "function_call": lambda v: v not in (None, "none"),
    "parallel_tool_calls": _truthy,
    "response_format": lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
    "logit_bias": _truthy,
    "presence_penalty": _truthy,
    "frequency_penalty": _truthy,
    "echo": _truthy,
    "suffix": _truthy,
    "audio": _truthy,
    "modalities": lambda v: v not in (None, ["text"]),
    "prediction": _truthy,
    "reasoning_effort": _truthy,
    "web_search_options": _truthy,
}
WHY = {"n": "one choice per request", "best_of": "one choice per request"}
IGNORED = ("user", "metadata", "store", "service_tier")  # accepted, no effect on decoding


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # e.g. "name"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class DdspecOptions(BaseModel):
    """The extra body field ``"ddspec": {...}``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    method: str | None = None  # any --method value (vanilla, eagle2, ddspec, eagle2@d3k2n3, ...)
    trace: bool = False  # stream each step's draft tree (the page asks for it)
    prefix_reuse: bool = True  # reuse the caches' common prefix with the last request


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # not OpenAI's; vLLM and llama.cpp accept it too
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch.Generator takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ddspec: DdspecOptions = DdspecOptions()
    n: int | None = None
    best_of: int | None = None


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]


@dataclass(frozen=True, slots=True)
class Request:
    """One checked request: everything the worker and the response writer need."""

    kind: Literal["chat", "completion"]
    model: str | None
    messages: list[dict[str, str]] | None  # chat
    prompt: str | list[int] | None  # completion: text, or token ids
    max_tokens: int | None  # None = the server's default (capped by the context)
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    method: str | None  # None = the server's default
    trace: bool
    prefix_reuse: bool


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _surrogate_at(body) -> str:
    """Where the first lone surrogate of a decoded body is, as ``messages.0.content`` (iterative:
    the body may nest as deep as the JSON parser allows)."""
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return where or "the body"
        elif isinstance(value, dict):
            for k, v in value.items():
                if _has_surrogate(k):
                    return f"a key in {where or 'the body'}"
                stack.append((v, f"{where}.{k}" if where else k))
        elif isinstance(value, list):
            stack += [(v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(value)]
    return "the body"


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:  # one C-speed pass over every string; the slow walk only to name the place
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        where = _surrogate_at(body)
        raise ApiError(400, f"the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape) in "
                            f"{where}: text must be valid Unicode; pair the surrogate or remove it",
                       param=None if where.startswith(("a key", "the body")) else where) from None
    return body


def _check_supported(body: dict, fields: set[str]) -> None:
    bad = [k for k, test in UNSUPPORTED.items() if k in body and test(body[k])]
    if bad:
        names = ", ".join(f"{k} ({WHY[k]})" if k in WHY else k for k in bad)
        raise ApiError(400, f"unsupported parameter(s): {names}. ddspec answers with one text choice, "
                            "without log-probabilities, tools or penalties; remove them", param=bad[0],
                       code="unsupported_parameter")
    unknown = sorted(k for k in body if k not in fields and k not in UNSUPPORTED and k not in IGNORED)
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s) supplied: {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        first = first or loc.split(".")[0]
        parts.append(f"{loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                   not isinstance(err["input"], (dict, list)) else ""))
    return "invalid request: " + "; ".join(parts[:8]), first


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4:
        raise ApiError(400, f"stop takes at most 4 strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return stops


def parse_request(kind: Literal["chat", "completion"], body: dict, defaults: SamplingConfig) -> Request:
    """Check a decoded body; ``defaults`` fill the sampling settings the request leaves out."""
    model_cls = ChatBody if kind == "chat" else CompletionBody
    _check_supported(body, set(model_cls.model_fields))
    try:
        req = model_cls.model_validate(body)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise ApiError(400, message, param=param) from None
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise ApiError(400, f"max_tokens ({req.max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                            "disagree: give one of them", param="max_tokens")
    if req.ddspec.method is not None:
        try:
            split_method(req.ddspec.method)
        except ConfigError as e:
            raise ApiError(400, f"ddspec.method: {e}", param="ddspec.method") from None
    try:
        sampling = SamplingConfig(
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            top_k=defaults.top_k if req.top_k is None else req.top_k,
            seed=defaults.seed if req.seed is None else req.seed,
        )
    except ConfigError as e:
        raise ApiError(400, str(e)) from None
    prompt = None
    if kind == "completion":
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, got {len(prompt)} (batches are not supported)",
                               param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
    return Request(
        kind=kind, model=req.model,
        messages=[{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                  for m in req.messages] if kind == "chat" else None,
        prompt=prompt,
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        sampling=sampling, stop=_stop_strings(req.stop), stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        method=req.ddspec.method, trace=req.ddspec.trace, prefix_reuse=req.ddspec.prefix_reuse,
    )

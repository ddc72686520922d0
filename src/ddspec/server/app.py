"""The HTTP side: OpenAI-compatible routes, server-sent events, the chat page, health and metrics.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models[/{id}]``,
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (the chat page, static files
under ``/static``). With an API key, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY``
(compared in constant time); the page and ``/health`` stay open and hold no data.

Before any route, :class:`Guard` checks where a request comes from: its ``Host`` must be on
the allow-list (loopback names by default, so a DNS-rebinding page cannot reach the server under
its own name: 400), and a browser's ``Origin`` must be the server's own or an allowed one (403;
allowed ones get CORS headers and preflight answers). A completion request must be JSON
(``Content-Type: application/json``, else 415: a cross-site form or ``text/plain`` post cannot be
one), read within the body deadline (408) and size limit (413), decoded (400), checked (400, see
protocol.py), matched to the served model (404) and method (400), and admitted to the worker's
queue (429 beyond the bound) before any work is done for it: the worker tokenizes the prompt (a
long one holds neither the event loop nor a place the queue has not granted) and checks it
against the context window (400 with both numbers). A prompt too long for the window by its
character count alone is refused at once. Its answer waits for the first event, so an error
found by the worker still gets its own status code; then a streaming request gets SSE chunks as
the engine decides tokens. Every wait also watches the client: one that has gone away cancels
its job, which stops within one decoding step (or one prefill chunk).

Errors are mapped to responses in one place (:func:`error_response`, the app's exception
handlers): ApiError as it says, any other DdspecError (a user's setting) 400, a client that left
mid-upload 499 (counted, never answered), anything else 500. JSON bodies are written with ASCII
escapes, so no text a client sent can break the writing of an answer.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import time
from dataclasses import dataclass
from importlib import resources

import json
from urllib.parse import urlsplit

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.errors import ConfigError, DdspecError
from ddspec.methods import split_method, tree_config
from ddspec.prompts import chat_prompt_ids
from ddspec.server.metrics import Metrics
from ddspec.server.protocol import ApiError, Request, parse_json, parse_request
from ddspec.server.responses import FINISH, Answer, sse, trace_of, usage
from ddspec.server.worker import EngineWorker, Job

STATIC = resources.files("ddspec.server") / "static"
POLL_S = 0.25  # how often a waiting handler checks that its client is still there
MAX_SIZES = {"depth": 16, "top_k": 16, "total_tokens": 128}  # per-request tree sizes (METHOD@dXkYnZ)
# the Host names a loopback server answers to by default (any port): a DNS-rebinding page
# reaches the server under its own name, which is not on the list
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str  # the id clients pass as "model"
    methods: tuple[str, ...]  # methods this server can run (vanilla only without a draft head)
    tree: TreeConfig  # the tree sizes of the --depth / --total-tokens ... flags
    sampling: SamplingConfig  # defaults for what a request leaves out
    max_tokens: int = 256  # default completion length (capped by the context window)
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    prefix_reuse: bool = True
    # Host header names (``name`` for any port, ``name:port`` for one); "*" = any
    allow_hosts: tuple[str, ...] = LOOPBACK_HOSTS
    # browser origins allowed besides the server's own (``http://host:port``); "*" = any
    allow_origins: tuple[str, ...] = ()
    body_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    special_tokens: bool = False  # special tokens typed in chat messages become control tokens


def draft_depth(method: str, tree: TreeConfig) -> int:
    """The deepest position a method drafts past its root (0 for vanilla)."""
    from ddspec.tree import DEFAULT_STATIC_PATHS

    cfg = tree_config(method, tree)
    if cfg is None:
        return 0
    if cfg.depth_policy != "fixed":
        return cfg.max_depth
    if cfg.shape == "static":
        return max(len(p) for p in cfg.static_paths or DEFAULT_STATIC_PATHS)
    return cfg.depth


def param_text(param: str) -> str:
    return "the prompt" if param == "prompt" else "it (or the chat history)"


def max_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` spells (its longest vocabulary entry; a
    byte-level or SentencePiece entry is never shorter than the text it stands for)."""
    try:
        return max(8, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 64


class ClientGone(Exception):
    """The client closed the connection while its request waited or streamed."""


class Service:
    """What the routes share: the worker, a tokenizer of their own, limits and metrics."""

    def __init__(self, worker: EngineWorker, config: ServerConfig) -> None:
        self.worker, self.config = worker, config
        target = worker.engine.target
        # the worker's tokenizer is used only by its thread (prompts are tokenized there); handlers (one
        # event loop) decode the page's trace texts with a copy
        self.tokenizer = copy.deepcopy(target.tokenizer)
        self.window = target.info.max_position
        self.vocab_size = target.info.vocab_size
        self.max_token_chars = max_token_chars(target.tokenizer)
        self.metrics = Metrics(lambda: worker.depth)
        worker.on_step = self.metrics.step

    # -- request -> job -------------------------------------------------------------------
    def prompt_ids(self, req: Request, tokenizer) -> list[int]:
        """The request's prompt as token ids (on the worker's thread, with its tokenizer)."""
        if req.kind == "chat":
            try:
                return chat_prompt_ids(tokenizer, req.messages, special_tokens=self.config.special_tokens)
            except DdspecError as e:
                raise ApiError(400, str(e), param="messages") from None
        if isinstance(req.prompt, str):
            return tokenizer.encode(req.prompt)
        bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return list(req.prompt)

    def window_for(self, method: str) -> tuple[int, str]:
        """The context a method's prompt and completion must fit in, and a note on why it is smaller."""
        # draft trees are verified at positions past the root: keep them inside the window
        window = self.window - max(0, draft_depth(method, self.config.tree) - 1)
        return window, "" if window == self.window else f" ({self.window} less the draft room of method {method})"

    def budget(self, prompt_len: int, asked: int | None, method: str, param: str = "messages") -> int:
        """Tokens to generate; a request that cannot fit gets a 400 with both numbers."""
        window, where = self.window_for(method)
        if prompt_len >= window:
            raise ApiError(400, f"This model's maximum context length is {window} tokens{where}, but the prompt "
                                f"is {prompt_len} tokens: shorten {param_text(param)}", param=param,
                           code="context_length_exceeded")
        if asked is not None and prompt_len + asked > window:
            raise ApiError(400, f"This model's maximum context length is {window} tokens{where}, but you requested "
                                f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the "
                                f"completion): lower max_tokens to at most {window - prompt_len} or shorten "
                                f"{param_text(param)}", param="max_tokens", code="context_length_exceeded")
        return asked if asked is not None else min(self.config.max_tokens, window - prompt_len)

    def check_length(self, req: Request, method: str) -> None:
        """Refuse at once a prompt whose characters alone show that it cannot fit the window (no token
        of this tokenizer spells more than ``max_token_chars`` characters), without tokenizing it."""
        if req.kind == "chat":
            chars, param = sum(len(m["content"]) for m in req.messages), "messages"
        elif isinstance(req.prompt, str):
            chars, param = len(req.prompt), "prompt"
        else:
            chars, param = len(req.prompt), "prompt"  # token ids: one each
            if chars >= self.window_for(method)[0]:
                self.budget(chars, req.max_tokens, method, param)
            return
        window, where = self.window_for(method)
        if chars > 2 * window * self.max_token_chars:  # 2: a normalizer may fold characters together
            raise ApiError(400, f"This model's maximum context length is {window} tokens{where}, but the prompt is "
                                f"{chars} characters, more than {window} tokens of this tokenizer can spell (at most "
                                f"{self.max_token_chars} characters each, twice that after normalization): shorten "
                                f"{param_text(param)}", param=param,
                           code="context_length_exceeded")

    def job(self, req: Request, loop: asyncio.AbstractEventLoop) -> Job:
        """A job for the worker, after every check that needs no tokenizer (the worker tokenizes)."""
        if req.model is not None and req.model != self.config.model_name:
            raise ApiError(404, f"The model `{req.model}` does not exist or you do not have access to it. "
                                f"This server serves `{self.config.model_name}`.", param="model",
                           code="model_not_found")
        method = req.method or self.worker.default_method
        name, sizes = split_method(method)
        if name not in self.config.methods:
            raise ApiError(400, f"ddspec.method {method!r} is not available here: this server runs "
                                f"{', '.join(self.config.methods)} (tree methods need a draft head)",
                           param="ddspec.method")
        too_big = {k: v for k, v in sizes.items() if k in MAX_SIZES and v > MAX_SIZES[k]}
        if too_big and method != self.worker.default_method:
            raise ApiError(400, f"ddspec.method {method!r}: a request's tree may have at most depth "
                                f"{MAX_SIZES['depth']}, top_k {MAX_SIZES['top_k']} and {MAX_SIZES['total_tokens']} "
                                "tokens (start the server with bigger ones instead)", param="ddspec.method")
        try:
            tree_config(method, self.config.tree)  # sizes in range (eagle2@d0 is not a tree)
        except ConfigError as e:
            raise ApiError(400, f"ddspec.method {method!r}: {e}", param="ddspec.method") from None
        self.check_length(req, method)
        param = "messages" if req.kind == "chat" else "prompt"
        tokenizer = self.worker.engine.target.tokenizer  # the worker's: prepare runs on its thread

        def prepare() -> tuple[list[int], StopConfig]:
            ids = self.prompt_ids(req, tokenizer)
            if not ids:
                raise ApiError(400, f"the prompt is empty after tokenization: give {param} some text", param=param)
            budget = self.budget(len(ids), req.max_tokens, method, param)
            return ids, StopConfig(max_new_tokens=budget, stop_strings=req.stop)

        return Job(None, None, req.sampling, method, req.prefix_reuse and self.config.prefix_reuse, req.trace, loop,
                   prepare=prepare)

    # -- auth -----------------------------------------------------------------------------
    def authorize(self, request: HttpRequest) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY' (the key "
                                "the server was started with: --api-key or DDSPEC_API_KEY).", code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    # -- waiting on a job -----------------------------------------------------------------
    async def next_event(self, job: Job, request: HttpRequest) -> tuple[str, object]:
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    raise ClientGone from None


async def read_body(request: HttpRequest, limit: int, timeout_s: float) -> bytes:
    """The request's body: at most ``limit`` bytes (413), all of it within ``timeout_s`` (408: a
    client that sends half a body and waits holds a connection and a task). Both errors close the
    connection (the rest of the body is never read)."""
    close = {"Connection": "close"}
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes; this server takes at most {limit} "
                            "(--max-body-bytes)", code="request_too_large", headers=close)
    parts, total = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                total += len(part)
                if total > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes, the most this server takes "
                                        "(--max-body-bytes)", code="request_too_large", headers=close)
                parts.append(part)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s ({total} bytes came): send it "
                            "at once (the server's --body-timeout)", code="request_timeout", headers=close) from None
    return b"".join(parts)


def check_json(request: HttpRequest) -> None:
    """A completion request's body must say it is JSON: 415 for any other type, or none. (A web
    page can post a form or ``text/plain`` to any site without asking; JSON needs the site's consent.)"""
    given = request.headers.get("content-type")
    media = (given or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                            f"{repr(given) if given is not None else 'no Content-Type'}", code="unsupported_media_type")


# -- errors: mapped to responses in one place ----------------------------------------------
class AsciiJSONResponse(JSONResponse):
    """JSON with ASCII escapes: any string (a lone surrogate a client sent, say) can be written."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(e: ApiError) -> Response:
    return AsciiJSONResponse(e.body(), status_code=e.status, headers=e.headers)


def as_api_error(e: BaseException) -> ApiError | None:
    """The ApiError a client mistake stands for (None: not the client's; a 500)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, DdspecError):  # a user-facing setting out of range, raised below the routes
        return ApiError(400, str(e))
    if isinstance(e, StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail), headers=getattr(e, "headers", None))
    return None


# -- the app ------------------------------------------------------------------------------
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/")


class CountRequests:
    """ASGI middleware: count answered requests by endpoint and status (streaming-safe)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = next((e for e in ENDPOINTS if path == e or (e == "/v1/models" and path.startswith(e))),
                            "static" if path.startswith("/static/") else "other")
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """``host`` (a Host header: ``name`` or ``name:port``) against ``allowed`` (``name`` = any port)."""
    if "*" in allowed:
        return True
    host = host.strip().lower()
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") and "]:" in host else host
    return host in allowed or name in allowed


class Guard:
    """ASGI middleware: where a request comes from. The Host must be allowed (DNS rebinding: 400);
    a browser's Origin must be the server's own (same host and port) or allowed (403), and an
    allowed other origin gets CORS headers and preflight (OPTIONS) answers."""

    ALLOW_HEADERS = "authorization, content-type"

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.hosts = tuple(h.lower() for h in config.allow_hosts)
        self.origins = tuple(o.lower().rstrip("/") for o in config.allow_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host", "")
        if not host_allowed(host, self.hosts):
            hint = ", ".join(self.hosts)
            return await error_response(ApiError(
                400, f"the Host header {host!r} is not one this server answers to ({hint}): start it with "
                     f"--allow-host NAME to add a name (a page's script could otherwise reach it through DNS "
                     "rebinding)", code="invalid_host"))(scope, receive, send)
        origin = headers.get("origin")
        cors = {}
        if origin is not None:
            same = urlsplit(origin.lower()).netloc == host.lower() if origin.lower() != "null" else False
            if not same and "*" not in self.origins and origin.lower().rstrip("/") not in self.origins:
                return await error_response(ApiError(
                    403, f"cross-origin request from {origin!r} refused: this server answers pages from its own "
                         "origin only; start it with --allow-origin ORIGIN to allow another", code="origin_not_allowed"
                ))(scope, receive, send)
            if not same:
                cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
                if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                    await Response(status_code=204, headers={
                        **cors, "Access-Control-Allow-Methods": "GET, HEAD, POST, OPTIONS",
                        "Access-Control-Allow-Headers": self.ALLOW_HEADERS, "Access-Control-Max-Age": "600",
                    })(scope, receive, send)
                    return
        if not cors:
            return await self.app(scope, receive, send)

        async def send_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) +
                           [(k.lower().encode(), v.encode("latin-1")) for k, v in cors.items()]}
            await send(message)

        await self.app(scope, receive, send_cors)


def create_app(service: Service) -> FastAPI:
    # redirect_slashes off: /health/ is a 404, not a redirect that clients re-send without their body
    app = FastAPI(title="ddspec", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    cfg = service.config
    app.add_middleware(Guard, config=cfg)
    app.add_middleware(CountRequests, metrics=service.metrics)  # outermost: counts the Guard's refusals too
    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @app.exception_handler(ApiError)
    @app.exception_handler(DdspecError)
    @app.exception_handler(StarletteHTTPException)
    async def client_error(_request, e: Exception):
        return error_response(as_api_error(e))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request, _e: ClientDisconnect):
        return Response(status_code=499)  # never sent (nobody is there); counted as the client's doing

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        return error_response(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error"))

    @app.api_route("/", methods=["GET", "HEAD"])
    async def page():
        return FileResponse(str(STATIC / "index.html"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        w = service.worker
        body = {"status": "ok" if w.alive else "error", "model": cfg.model_name, "method": w.default_method,
                "methods": list(cfg.methods), "queue_depth": w.depth, "max_queue": w.max_queue, "batch": w.batch,
                "busy": w.busy, "prefix_reuse": cfg.prefix_reuse, "context_window": service.window,
                "auth": cfg.api_key is not None}
        return AsciiJSONResponse(body, status_code=200 if w.alive else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: HttpRequest):
        service.authorize(request)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "ddspec"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: HttpRequest):
        service.authorize(request)
        return AsciiJSONResponse({"object": "list", "data": [model_card()]})

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str, request: HttpRequest):
        service.authorize(request)
        if model_id != cfg.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        return AsciiJSONResponse(model_card())

    async def complete(request: HttpRequest, kind: str):
        service.authorize(request)
        check_json(request)
        body = parse_json(await read_body(request, cfg.max_body_bytes, cfg.body_timeout_s))
        req = parse_request(kind, body, cfg.sampling)
        job = service.job(req, asyncio.get_running_loop())
        service.worker.submit(job)  # admission before any tokenization (the worker does it)
        answer = Answer(req, cfg.model_name, job.method)
        try:
            first = await service.next_event(job, request)
        except ClientGone:
            return Response(status_code=499)
        except BaseException:
            job.cancel()
            raise
        if first[0] == "error":
            raise first[1]
        if req.stream:
            return StreamingResponse(stream(job, first, answer, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(job, first, answer, request)

    async def events(job: Job, first, request: HttpRequest):
        """The job's events from ``first`` on, until done; records time to first token and tokens."""
        m = service.metrics
        event = first
        m.ttft.observe(time.perf_counter() - job.admitted)
        while True:
            kind, payload = event
            if kind == "chunk":
                m.generated_tokens.inc(len(payload.token_ids))
            elif kind == "done":
                m.finished(payload)
                m.latency.observe(time.perf_counter() - job.admitted)
            yield kind, payload
            if kind != "chunk":
                return
            event = await service.next_event(job, request)

    async def whole(job: Job, first, answer: Answer, request: HttpRequest):
        text, tokens = [], 0
        try:
            async for kind, payload in events(job, first, request):
                if kind == "error":
                    raise payload
                if kind == "chunk":
                    text.append(payload.text)
                    tokens += len(payload.token_ids)
                else:
                    stats = payload
        except ClientGone:
            return Response(status_code=499)
        finally:
            job.cancel()  # no-op when done
        return answer.whole("".join(text), FINISH[stats.finish_reason], usage(stats, tokens, job.method))

    async def stream(job: Job, first, answer: Answer, request: HttpRequest):
        req = answer.req
        tokens = 0
        try:
            if answer.chat:
                yield sse(answer.chunk(None, role=True))
            async for kind, payload in events(job, first, request):
                if kind == "error":  # mid-stream: the status is sent already; say it in the stream
                    yield sse(payload.body())
                    break
                if kind == "chunk":
                    tokens += len(payload.token_ids)
                    extra = trace_of(payload, service.tokenizer) if req.trace else None
                    if payload.text or extra:
                        yield sse(answer.chunk(payload.text, extra=extra))
                    continue
                yield sse(answer.chunk(None if answer.chat else "", FINISH[payload.finish_reason]))
                if req.include_usage or req.trace:
                    yield sse(answer.usage_chunk(usage(payload, tokens, job.method)))
            yield sse("[DONE]")
        except ClientGone:
            pass
        finally:
            job.cancel()  # the client left (or we are done): the worker stops within one step

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, "completion")

    return app

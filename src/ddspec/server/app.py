"""The HTTP side: OpenAI-compatible routes, server-sent events, the chat page, health and metrics.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models[/{id}]``,
``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /`` (the chat page, static files
under ``/static``). With an API key, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer KEY``
(compared in constant time); the page and ``/health`` stay open and hold no data.

A request is read (size limit: 413), decoded (400), checked (400 / 422, see protocol.py),
matched to the served model (404), tokenized here, checked against the context window (400
with both numbers), and queued on the worker (429 beyond the bound). Its answer waits for the
first event, so an error found by the worker still gets its own status code; then a streaming
request gets SSE chunks as the engine decides tokens. Every wait also watches the client: one
that has gone away cancels its job, which stops within one decoding step.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import time
from dataclasses import dataclass
from importlib import resources

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddspec.config import SamplingConfig, StopConfig, TreeConfig
from ddspec.errors import DdspecError
from ddspec.methods import split_method, tree_config
from ddspec.prompts import chat_prompt_ids
from ddspec.server.metrics import Metrics
from ddspec.server.protocol import ApiError, Request, parse_json, parse_request
from ddspec.server.responses import FINISH, Answer, sse, trace_of, usage
from ddspec.server.worker import EngineWorker, Job

STATIC = resources.files("ddspec.server") / "static"
POLL_S = 0.25  # how often a waiting handler checks that its client is still there
MAX_SIZES = {"depth": 16, "top_k": 16, "total_tokens": 128}  # per-request tree sizes (METHOD@dXkYnZ)


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


class ClientGone(Exception):
    """The client closed the connection while its request waited or streamed."""


class Service:
    """What the routes share: the worker, a tokenizer of their own, limits and metrics."""

    def __init__(self, worker: EngineWorker, config: ServerConfig) -> None:
        self.worker, self.config = worker, config
        target = worker.engine.target
        # the worker's tokenizer is used only by its thread; handlers (one event loop) use a copy
        self.tokenizer = copy.deepcopy(target.tokenizer)
        self.window = target.info.max_position
        self.vocab_size = target.info.vocab_size
        self.metrics = Metrics(lambda: worker.depth)
        worker.on_step = self.metrics.step

    # -- request -> job -------------------------------------------------------------------
    def prompt_ids(self, req: Request) -> list[int]:
        if req.kind == "chat":
            try:
                return chat_prompt_ids(self.tokenizer, req.messages)
            except DdspecError as e:
                raise ApiError(400, str(e), param="messages") from None
        if isinstance(req.prompt, str):
            return self.tokenizer.encode(req.prompt)
        bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return list(req.prompt)

    def budget(self, prompt_len: int, asked: int | None, method: str) -> int:
        """Tokens to generate; a request that cannot fit gets a 400 with both numbers."""
        # draft trees are verified at positions past the root: keep them inside the window
        window = self.window - max(0, draft_depth(method, self.config.tree) - 1)
        where = "" if window == self.window else f" ({self.window} less the draft room of method {method})"
        if prompt_len >= window:
            raise ApiError(400, f"This model's maximum context length is {window} tokens{where}, but the prompt "
                                f"is {prompt_len} tokens: shorten it (or the chat history)", param="messages",
                           code="context_length_exceeded")
        if asked is not None and prompt_len + asked > window:
            raise ApiError(400, f"This model's maximum context length is {window} tokens{where}, but you requested "
                                f"{prompt_len + asked} tokens ({prompt_len} in the prompt, {asked} for the "
                                f"completion): lower max_tokens to at most {window - prompt_len} or shorten the "
                                "prompt", param="max_tokens", code="context_length_exceeded")
        return asked if asked is not None else min(self.config.max_tokens, window - prompt_len)

    def job(self, req: Request, loop: asyncio.AbstractEventLoop) -> Job:
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
        ids = self.prompt_ids(req)
        stop = StopConfig(max_new_tokens=self.budget(len(ids), req.max_tokens, method), stop_strings=req.stop)
        return Job(ids, stop, req.sampling, method, req.prefix_reuse and self.config.prefix_reuse, req.trace, loop)

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


async def read_body(request: HttpRequest, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes; this server takes at most {limit} "
                            "(--max-body-bytes)", code="request_too_large")
    parts, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, the most this server takes "
                                "(--max-body-bytes)", code="request_too_large")
        parts.append(part)
    return b"".join(parts)


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


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="ddspec", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = service.config
    app.add_middleware(CountRequests, metrics=service.metrics)
    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request, e: Exception):
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(),
                            status_code=500)

    @app.get("/")
    async def page():
        return FileResponse(str(STATIC / "index.html"))

    @app.get("/health")
    async def health():
        w = service.worker
        body = {"status": "ok" if w.alive else "error", "model": cfg.model_name, "method": w.default_method,
                "methods": list(cfg.methods), "queue_depth": w.depth, "max_queue": w.max_queue, "busy": w.busy,
                "prefix_reuse": cfg.prefix_reuse, "context_window": service.window,
                "auth": cfg.api_key is not None}
        return JSONResponse(body, status_code=200 if w.alive else 503)

    @app.get("/metrics")
    async def metrics(request: HttpRequest):
        service.authorize(request)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict:
        return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "ddspec"}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        service.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: HttpRequest):
        service.authorize(request)
        if model_id != cfg.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist or you do not have access to it.",
                           param="model", code="model_not_found")
        return model_card()

    async def complete(request: HttpRequest, kind: str):
        service.authorize(request)
        req = parse_request(kind, parse_json(await read_body(request, cfg.max_body_bytes)), cfg.sampling)
        job = service.job(req, asyncio.get_running_loop())
        service.worker.submit(job)
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

"""Putting a server together around a loaded target, and running it in a background thread.

``make_service`` is what ``ddspec serve`` does after loading the model (tests and
``ddspec bench-serve`` call it with their own targets); ``uvicorn_options`` are the connection
limits both ``ddspec serve`` and ``LiveServer`` give uvicorn; ``LiveServer`` runs uvicorn in a
thread on a free loopback port, for tests and the benchmark.
"""

from __future__ import annotations

import threading
import time

from ddspec.config import SamplingConfig, TreeConfig
from ddspec.engine import Engine
from ddspec.errors import DdspecError
from ddspec.machine import free_port
from ddspec.methods import HEADLESS, METHODS, default_method, shipped_head, split_method
from ddspec.server.app import LOOPBACK_HOSTS, ServerConfig, Service, create_app
from ddspec.server.connections import protocol_class
from ddspec.server.worker import EngineWorker, tree_drafter_factory


def make_service(target, *, method: str = "auto", head: str | None = None, tree: TreeConfig = TreeConfig(),
                 sampling: SamplingConfig = SamplingConfig(), max_tokens: int = 256, api_key: str | None = None,
                 max_queue: int = 16, max_body_bytes: int = 1 << 20, prefix_reuse: bool = True,
                 model_name: str | None = None, allow_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
                 allow_origins: tuple[str, ...] = (), body_timeout_s: float = 30.0,
                 special_tokens: bool = False, batch: int = 1) -> Service:
    """A started worker and its Service; the default method's drafter is built here (a missing head
    or a calibration fails now, not at the first request). batch > 1: a BatchWorker decoding up to
    that many requests together (server/batch.py)."""
    if max_tokens < 1:
        raise DdspecError(f"--max-new-tokens must be >= 1, got {max_tokens}")
    if not body_timeout_s > 0:
        raise DdspecError(f"--body-timeout must be > 0 seconds, got {body_timeout_s}")
    has_head = head is not None or shipped_head(target.info) is not None or tree.draft_model is not None
    methods = METHODS if has_head else HEADLESS
    method = default_method(target, head, tree.draft_model) if method == "auto" else method
    if split_method(method)[0] not in methods:
        raise DdspecError(f"--method {method} needs a draft head, and {target.info.name} has none: pass --head "
                          "FOLDER or --draft-model FILE, or use --method vanilla or lookup")
    if batch > 1:
        from ddspec.server.batch import BatchWorker

        worker = BatchWorker(target, tree_drafter_factory(target, head, tree), method, batch, max_queue)
    else:
        worker = EngineWorker(Engine(target, reuse_prefix=prefix_reuse), tree_drafter_factory(target, head, tree),
                              method, max_queue)
    worker.drafter(method)
    config = ServerConfig(model_name=model_name or served_name(target.info.name), methods=methods, tree=tree,
                          sampling=sampling, max_tokens=max_tokens, api_key=api_key or None,
                          max_body_bytes=max_body_bytes, prefix_reuse=prefix_reuse, allow_hosts=tuple(allow_hosts),
                          allow_origins=tuple(allow_origins), body_timeout_s=body_timeout_s,
                          special_tokens=special_tokens)
    service = Service(worker, config)
    worker.start()
    return service


def served_name(name: str) -> str:
    """The model id clients use: the model's name, or a local folder's last part."""
    return name.rstrip("/").rsplit("/", 1)[-1] or name


def uvicorn_options(header_timeout_s: float = 10.0, keep_alive_s: float = 5.0, max_connections: int = 256) -> dict:
    """uvicorn.Config keywords for ddspec's connection limits (see connections.py): a request's
    headers within ``header_timeout_s``, an idle keep-alive connection closed after ``keep_alive_s``,
    at most ``max_connections`` open sockets (idle ones make room)."""
    for flag, value in (("--header-timeout", header_timeout_s), ("--keep-alive-timeout", keep_alive_s)):
        if not value > 0:
            raise DdspecError(f"{flag} must be > 0 seconds, got {value}")
    if max_connections < 2:
        raise DdspecError(f"--max-connections must be >= 2, got {max_connections}")
    return {"http": protocol_class(header_timeout_s, max_connections), "timeout_keep_alive": keep_alive_s}


class LiveServer:
    """uvicorn serving ``service`` in a daemon thread; ``with LiveServer(service) as url: ...``."""

    def __init__(self, service: Service, host: str = "127.0.0.1", port: int | None = None, **limits) -> None:
        """limits: uvicorn_options' keywords (header_timeout_s, keep_alive_s, max_connections)."""
        import uvicorn

        self.service = service
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(create_app(service), host=self.host, port=self.port, log_level="warning",
                                lifespan="off", **uvicorn_options(**limits))
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="ddspec-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.service.worker.stop()

    def __enter__(self) -> str:
        return self.start().url

    def __exit__(self, *exc) -> None:
        self.stop()

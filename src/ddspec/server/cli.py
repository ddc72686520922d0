"""``ddspec serve`` (the OpenAI-compatible server) and ``ddspec bench-serve`` (its load benchmark)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ddspec.args import add_model_args, add_sampling_args, add_spec_args, sampling_from_args, setup_torch, target_from_args, \
    tree_from_args
from ddspec.server import AUTO_BATCH, default_batch

API_KEY_ENV = "DDSPEC_API_KEY"


def batch_size(text: str) -> int:
    """--batch's value: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of requests, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with a chat page that shows the draft tree",
        description="Serve one model over the OpenAI API (POST /v1/chat/completions, /v1/completions, "
                    "streaming or not; GET /v1/models, /health, /metrics) and a chat page at /. Model, head and "
                    "method are chosen as in `ddspec generate`; a request may pick another method with the extra "
                    "body field {\"ddspec\": {\"method\": \"eagle2\"}}. The decoding flags below are the defaults "
                    "for what a request leaves out (so requests without a temperature are greedy).")
    add_server_args(p)
    add_model_args(p)
    add_sampling_args(p, stop_strings=False, title="request defaults")
    add_spec_args(p)
    p.set_defaults(handler=cmd_serve)

    from ddspec.server.bench import add_bench_parser

    add_bench_parser(sub)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: ${API_KEY_ENV}, "
                        "else no key)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model's name, or its folder's name)")
    g.add_argument("--batch", type=batch_size, default=None, metavar="N",
                   help="decode up to N requests together, one target forward per step for all of them "
                        "(continuous batching; each answer is the one it gets alone, and the cost-aware method "
                        "sizes every tree for the whole batch); 1: one request at a time. Default: "
                        f"{AUTO_BATCH} on the native CPU target (a lone client is served as fast as with 1, "
                        "several at once faster; each slot keeps the KV cache its longest request needed), 1 on "
                        "others")
    g.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait or run at once; more get 429 with Retry-After (default 16)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; larger ones get 413 (default 1 MiB)")
    g.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                   help="prefill every prompt from scratch (default: keep the KV of the longest common prefix "
                        "with the previous request, e.g. a chat's history)")
    g.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                   help="a Host header name the server answers to, NAME (any port) or NAME:PORT; repeat for more, "
                        "'*' for any (default: localhost, 127.0.0.1 and [::1] only, on any port; other names get 400, "
                        "which stops a web page's DNS-rebinding tricks; add the names clients use when serving on "
                        "another address)")
    g.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="a browser origin (scheme://host[:port]) whose pages may call the API, with CORS headers; "
                        "repeat for more, '*' for any (default: none but the server's own, i.e. the chat page; "
                        "other origins get 403)")
    g.add_argument("--allow-special-tokens", action="store_true",
                   help="let special tokens typed in chat messages (e.g. <|im_end|>) act as control tokens (default: "
                        "they are tokenized as plain text, so a message cannot end its turn or forge another role's; "
                        "a /v1/completions prompt is raw and always keeps them)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a connection has to send a request's headers, from its opening or its previous "
                        "answer; then it is closed (default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request's whole body has to arrive; then 408 and the connection is closed "
                        "(default 30)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0, metavar="S",
                   help="seconds an idle keep-alive connection stays open after an answer (default 5)")
    g.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="open connections at most; past it a new one closes the oldest connection still waiting for "
                        "its headers, or gets 503 when all are busy, so idle sockets cannot lock out /health (default "
                        "256; the open-files limit is raised to its hard maximum at start)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from ddspec.errors import DdspecError

    if not 0 < args.port < 65536:
        raise DdspecError(f"--port must be in 1..65535, got {args.port}")
    if args.max_body_bytes < 1024:
        raise DdspecError(f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}")
    if not is_loopback(args.host) and not args.api_key:
        print(f"ddspec serve: warning: listening on {args.host} without an API key: anyone who can reach this "
              f"port can use the model. Pass --api-key KEY (or set {API_KEY_ENV}).", file=sys.stderr)
    sampling, tree = sampling_from_args(args), tree_from_args(args)
    setup_torch(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise DdspecError(f"ddspec serve needs {e.name}: pip install 'ddspec[serve]' (fastapi, uvicorn, "
                          "prometheus_client)") from None

    from ddspec.server.app import LOOPBACK_HOSTS, create_app
    from ddspec.server.build import make_service, uvicorn_options

    limits = uvicorn_options(args.header_timeout, args.keep_alive_timeout, args.max_connections)
    allow_hosts = tuple(args.allow_host or LOOPBACK_HOSTS)
    if not args.allow_host and not is_loopback(args.host):
        print(f"ddspec serve: note: requests must name this server as {', '.join(LOOPBACK_HOSTS)} in their Host "
              f"header; pass --allow-host NAME for each name clients use to reach {args.host} (or '*')",
              file=sys.stderr)

    target = target_from_args(args)
    batch = args.batch or default_batch(target)
    service = make_service(target, method=args.method, head=args.head, tree=tree, sampling=sampling,
                           max_tokens=args.max_new_tokens, api_key=args.api_key, max_queue=args.max_queue, batch=batch,
                           max_body_bytes=args.max_body_bytes, prefix_reuse=args.prefix_reuse,
                           model_name=args.served_model_name, allow_hosts=allow_hosts,
                           allow_origins=tuple(args.allow_origin or ()), body_timeout_s=args.body_timeout,
                           special_tokens=args.allow_special_tokens)
    cfg = service.config
    together = f", up to {batch} requests decoded together" if batch > 1 else ", one request at a time"
    print(f"ddspec serve: {cfg.model_name} ({service.worker.default_method}{together}) on http://{args.host}:{args.port} "
          f"- chat page at /, OpenAI API at /v1" + (", API key required" if cfg.api_key else ""), file=sys.stderr)
    try:
        from ddspec.server.connections import raise_file_limit

        raise_file_limit()
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5, **limits)
    finally:
        service.worker.stop()
    return 0

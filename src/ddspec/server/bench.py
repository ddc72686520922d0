"""``ddspec bench-serve``: load on the OpenAI server, and what prefix reuse saves a chat.

1. Throughput and latency: for each method (per request, through ``"ddspec": {"method": M}``) and
   each concurrency level, ``--requests`` streaming chat requests (first turns of the prompt
   file, greedy) are sent by that many concurrent clients; reported: requests/s, generated
   tokens/s, p50/p99 latency, p50 time to first token, τ. Every run repeats the same prompts, so
   each request asks for its whole prompt to be prefilled (ddspec's ``"prefix_reuse": false``,
   llama.cpp's ``"cache_prompt": false``): a server whose caches still held a prompt from the run
   before would otherwise skip its prefill.
2. Prefix reuse: a three-turn chat (a prompt's two turns, then ``FOLLOW_UP``) is answered; then,
   ``--reuse-trials`` times, turn 2 is sent again (which puts the history in the caches) and
   turn 3 is timed to its first token with reuse, then without (``"prefix_reuse": false``).

The server runs in this process on a free loopback port (or pass ``--url`` to measure a running
one); ``--batch 1,16`` starts one per value. With ``--llama-server PATH`` llama.cpp's own server
(``--slots`` slots, the same GGUF and threads) is measured too, by the same clients (method
``llama.cpp``). All servers start first, and at each concurrency level the arms take turns (each
idles while another is measured), ``--repeats`` times, so that a drift in the machine's speed hits
them alike; a row is the median run, and each method is also given as a run-by-run ratio to
vanilla on the same server (speculation on / off at that load); from 6 run pairs under load (two or
more clients), their pooled median with a bootstrap 95% interval says whether the run can tell the
two apart. Column "= solo": how many of a row's answers (all its runs) equal the first arm's answer
to the same prompt in its first run at the first concurrency (with ``--batch 1`` first and
``--concurrency 1`` first: each answer decoded alone); greedy decoding under load is lossless when
they all do (ddspec's servers only).
Clients are threads with plain ``http.client``, which cost little next to decoding.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

FOLLOW_UP = "Summarise everything you said so far in three sentences."
DEFAULT_PROMPTS = "mt-bench"  # a shipped prompt set (ddspec.datasets) or a JSONL file


@dataclass(slots=True)
class Sample:
    latency_s: float
    ttft_s: float
    tokens: int
    tau: float | None  # None (as the next two): a server that does not report ddspec's usage fields
    prompt_tokens: int | None
    reused_tokens: int | None
    prefill_ms: float | None
    text: str


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, llama: bool = False) -> None:
        """timeout: seconds a request may wait for the server's next bytes before it counts as an error;
        llama: the server is llama.cpp's (its own field turns its prompt cache off: ``cache_prompt``)."""
        parts = urlsplit(url)
        self.host, self.port, self.timeout, self.llama = parts.hostname, parts.port or 80, timeout, llama
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            return json.loads(resp.read())
        finally:
            conn.close()

    def chat(self, messages: list[dict], max_tokens: int, method: str | None = None,
             prefix_reuse: bool = True) -> Sample:
        """One streaming chat request, timed; raises on any status but 200. prefix_reuse=False: the
        server prefills the whole prompt, whatever its caches hold (ddspec's field, llama.cpp's own)."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ddspec": {"prefix_reuse": prefix_reuse}}
        if method:
            body["ddspec"]["method"] = method
        if self.llama:
            body["cache_prompt"] = prefix_reuse
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", json.dumps(body), self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
            ttft, usage, text, pieces = None, None, [], 0
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(piece)
                        pieces += 1
            latency = time.perf_counter() - t0
        finally:
            conn.close()
        # another OpenAI-compatible server (llama.cpp's) may send no usage, or none of ddspec's fields:
        # its tokens are then counted as the streamed pieces (one token each, as llama.cpp streams them)
        usage = usage or {}
        d = usage.get("ddspec") or {}
        return Sample(latency, ttft if ttft is not None else latency, usage.get("completion_tokens", pieces),
                      d.get("tau"), usage.get("prompt_tokens"), d.get("reused_prompt_tokens"), d.get("prefill_ms"),
                      "".join(text))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def load_run(client: Client, method: str, concurrency: int, prompts: list[str], requests: int,
             max_tokens: int) -> dict:
    """``requests`` chat requests by ``concurrency`` client threads; returns the aggregate row (with
    ``answers``: request number -> its text, for the comparison with the solo answers). Each request
    is prefilled in full: the runs repeat the same prompts, which a server's caches would otherwise
    still hold from the run before (prefix reuse is measured on its own: reuse_run)."""
    todo = iter(range(requests))
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[str] = []
    answers: dict[int, str] = {}

    def client_loop():
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                s = client.chat([{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens, method,
                                prefix_reuse=False)
            except Exception as e:  # noqa: BLE001 - reported in the row
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                samples.append(s)
                answers[i] = s.text

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(s.tokens for s in samples)
    lat = [s.latency_s for s in samples] or [float("nan")]
    return {"method": method, "concurrency": concurrency, "requests": len(samples), "errors": len(errors),
            "wall_s": round(wall, 3), "requests_per_s": round(len(samples) / wall, 3),
            "tokens_per_s": round(tokens / wall, 2), "p50_latency_s": round(statistics.median(lat), 4),
            "p99_latency_s": round(percentile(lat, 0.99), 4),
            "p50_ttft_s": round(statistics.median([s.ttft_s for s in samples] or [float("nan")]), 4),
            "tau": _mean_or_none([s.tau for s in samples]),
            "first_error": errors[0] if errors else "", "answers": answers}


def _mean_or_none(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.mean(known), 3) if known else None


def reuse_run(client: Client, method: str, turns: tuple[str, str], max_tokens: int, trials: int) -> dict:
    """Time to first token of a chat's third turn, with and without prefix reuse."""
    history: list[dict] = []
    for text in turns:
        history.append({"role": "user", "content": text})
        answer = client.chat(history, max_tokens, method)
        history.append({"role": "assistant", "content": answer.text})
    turn2, turn3 = history[:3], history + [{"role": "user", "content": FOLLOW_UP}]
    warm, cold = [], []
    for _ in range(trials):
        client.chat(turn2, max_tokens, method)  # the history is in the caches again
        warm.append(client.chat(turn3, 1, method))
        cold.append(client.chat(turn3, 1, method, prefix_reuse=False))
    w, c = statistics.median(s.ttft_s for s in warm), statistics.median(s.ttft_s for s in cold)
    return {"method": method, "history_tokens": warm[0].prompt_tokens, "reused_tokens": warm[0].reused_tokens,
            "ttft_reuse_s": round(w, 4), "ttft_cold_s": round(c, 4), "ratio": round(w / c, 3),
            "prefill_reuse_ms": round(statistics.median(s.prefill_ms for s in warm), 1),
            "prefill_cold_ms": round(statistics.median(s.prefill_ms for s in cold), 1), "trials": trials}


def report(rows: list[dict], reuse: dict, header: str, ratios: list[str] = ()) -> str:
    lines = [header, "", "| method | concurrency | requests | req/s | tokens/s | p50 latency s | p99 latency s | "
                         "p50 TTFT s | τ | = solo | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['p50_latency_s']:.3f} | {r['p99_latency_s']:.3f} | "
                     f"{r['p50_ttft_s']:.3f} | {'—' if r['tau'] is None else format(r['tau'], '.2f')} | "
                     f"{r.get('same_as_solo') or '—'} | {r['errors']} |")
    if ratios:
        lines += [""] + [f"- {line}" for line in ratios]
    if reuse:
        lines += ["", f"Third chat turn ({reuse['history_tokens']} prompt tokens, {reuse['reused_tokens']} kept by "
                      f"prefix reuse; method {reuse['method']}; median of {reuse['trials']}): time to first token "
                      f"{reuse['ttft_reuse_s']:.3f} s with reuse, {reuse['ttft_cold_s']:.3f} s without "
                      f"({reuse['ratio']:.0%}); prefill {reuse['prefill_reuse_ms']:.0f} ms vs "
                      f"{reuse['prefill_cold_ms']:.0f} ms."]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_bench_parser(sub) -> None:
    from ddspec.args import add_model_args, add_tree_args
    from ddspec.server import AUTO_BATCH

    p = sub.add_parser("bench-serve", help="load benchmark of `ddspec serve` (throughput, latency, prefix reuse)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="vanilla,ddspec",
                   help="methods to compare, comma-separated (default vanilla,ddspec)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="concurrent clients (default 1,4,16)")
    p.add_argument("--requests", type=int, default=16, help="requests per method and concurrency (default 16)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each row; the arms take turns at each load and each row reports its median "
                        "run by tokens/s, with the run-by-run ratio of each method to vanilla; from 6 run pairs "
                        "under load, their pooled median with a bootstrap 95%% interval (default 1)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"JSONL prompt file or a shipped set: mt-bench, humaneval, gsm8k (default {DEFAULT_PROMPTS})")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per load request (default 128)")
    p.add_argument("--chat-max-tokens", type=int, default=512,
                   help="tokens per answer of the reuse chat's first two turns (default 512)")
    p.add_argument("--reuse-trials", type=int, default=3, help="timed third turns, each way (default 3; 0 = skip)")
    p.add_argument("--url", default=None, help="measure a running server instead of starting one")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="also measure llama.cpp's llama-server binary on the same GGUF (--model FILE.gguf) with the "
                        "same clients, in the same run (docs/benchmarks.md builds it)")
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots (-np; default 16)")
    p.add_argument("--batch", type=_ints, default=None, metavar="N[,M...]",
                   help="ddspec's server with `serve --batch N` (requests decoded together), one server and one row "
                        "per method for each value: 1,16 compares one request at a time with batches of 16 "
                        f"(default: serve's, {AUTO_BATCH} on the native target, else 1)")
    p.add_argument("--api-key", default=None, help="the running server's key (with --url)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a request may wait for the server's next bytes; a request that waits longer "
                        "counts as an error of its row (default 600)")
    p.add_argument("--out", default=None,
                   help="folder for summary.md and results.json, rewritten as each load level completes")
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(handler=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ddspec.bench.prompts import load_prompt_file
    from ddspec.datasets import resolve_prompt_sources
    from ddspec.errors import DdspecError
    from ddspec.methods import split_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        split_method(m)
    if (args.requests < 1 or args.max_tokens < 1 or args.chat_max_tokens < 1 or args.reuse_trials < 0 or args.slots < 1
            or args.repeats < 1 or not args.request_timeout > 0):
        raise DdspecError("--requests, --max-tokens, --chat-max-tokens, --slots and --repeats must be >= 1, "
                          "--reuse-trials >= 0, --request-timeout > 0")
    if args.llama_server and (Path(args.model).suffix != ".gguf" or not Path(args.model).expanduser().is_file()):
        raise DdspecError(f"--llama-server measures llama.cpp on the same GGUF file: give --model FILE.gguf, not {args.model}")
    prompts = load_prompt_file(resolve_prompt_sources([args.prompts])[0])
    firsts = [p.turns[0] for p in prompts]
    two_turns = next((p.turns[:2] for p in prompts if len(p.turns) >= 2), None)
    if two_turns is None and args.reuse_trials:
        raise DdspecError(f"{args.prompts} has no prompt with two turns, which the prefix-reuse chat needs")
    if args.url is not None and args.batch is not None:
        raise DdspecError("--batch starts ddspec's own servers; it cannot change a running one (--url)")
    if args.batch is not None and min(args.batch) < 1:
        raise DdspecError(f"--batch values must be >= 1, got {args.batch}")
    with contextlib.ExitStack() as stack:
        arms, health = _open_arms(args, methods, stack)
        runs: dict[tuple[str, int], list[dict]] = {}
        for i, c in enumerate(args.concurrency):  # every arm at this load, in turn, --repeats times
            for rep in range(args.repeats):
                # the order reversed every other time: an arm that always ran after another would carry
                # whatever the one before leaves to the run after it (the collector's work, a cooler cache)
                for arm in arms if rep % 2 == 0 else arms[::-1]:
                    r = dict(load_run(arm.client, arm.method, c, firsts, args.requests, args.max_tokens),
                             method=arm.label)
                    runs.setdefault((arm.label, c), []).append(r)
                    print(f"[bench-serve] {arm.label} x{c}" + (f" ({rep + 1}/{args.repeats})" if args.repeats > 1 else "")
                          + f": {r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} tokens/s, p50 "
                          f"{r['p50_latency_s']:.3f} s, p99 {r['p99_latency_s']:.3f} s, errors {r['errors']}",
                          file=sys.stderr)
            if args.out and i + 1 < len(args.concurrency):  # what is measured so far survives a stopped run
                _write_out(args, arms, runs, args.concurrency[:i + 1], {}, health, complete=False)
        reuse = {}
        if args.reuse_trials:
            ours = [a for a in arms if a.ours]
            if not ours:
                print("[bench-serve] the server reports no prefix reuse (not ddspec's usage fields): the reuse "
                      "chat is skipped", file=sys.stderr)
            else:
                reuse = reuse_run(ours[-1].client, ours[-1].method, two_turns, args.chat_max_tokens, args.reuse_trials)
    text, rows = _write_out(args, arms, runs, args.concurrency, reuse, health, complete=True)
    print(text)
    return 1 if any(r["errors"] for r in rows) else 0


def _write_out(args: argparse.Namespace, arms: list[Arm], runs: dict, levels: list[int], reuse: dict, health: dict,
               complete: bool) -> tuple[str, list[dict]]:
    """The report of the load levels measured so far (to --out when given)."""
    solo = runs[(arms[0].label, levels[0])][0]["answers"]  # the first arm's first run at the first load
    rows = [dict(median_run(runs[(a.label, c)]), same_as_solo=_same_as(solo, runs[(a.label, c)]) if a.ours else None)
            for a in arms for c in levels]
    for r in rows:
        r.pop("answers")
    header = (f"ddspec bench-serve: model {health.get('model', args.url or 'a local server')}, prompts {args.prompts} "
              f"(first turns, greedy, {args.max_tokens} tokens), {args.requests} requests per row"
              + (f", the server decoding up to {health['batch']} requests together" if len(args.batch or [0]) == 1
                 and health.get("batch", 1) > 1 else "")
              + (f", median of {args.repeats} runs by tokens/s (arms interleaved, in turn forwards and backwards)"
                 if args.repeats > 1 else "")
              + f", {time.strftime('%Y-%m-%d %H:%M')}"
              + ("" if complete else f" (incomplete: concurrency {','.join(map(str, levels))} measured so far)"))
    text = report(rows, reuse, header, paired_ratios(arms, runs, levels))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(text)
        (out / "results.json").write_text(json.dumps({"rows": rows, "reuse": reuse, "complete": complete, "args": {
            k: v for k, v in vars(args).items() if k != "handler" and k != "api_key"}}, indent=2, default=str))
    return text, rows


@dataclass(slots=True)
class Arm:
    """One measured configuration: a server (client), the method its requests name, the row label."""
    label: str
    client: Client
    method: str | None
    ours: bool = False  # the server reports ddspec's usage fields


def _open_arms(args: argparse.Namespace, methods: list[str], stack: contextlib.ExitStack) -> tuple[list[Arm], dict]:
    """Every server the run measures, started at once (each idles while another is measured):
    ddspec's, one per --batch value (or the --url one), then llama.cpp's with --llama-server."""
    arms, health = [], {}
    for b in [None] if args.url is not None else args.batch or [0]:  # 0: serve's default
        if b is None:
            url = args.url
        else:
            live = _start_server(args, methods, b)
            stack.callback(live.stop)
            url = live.url
        client = Client(url, args.api_key, args.request_timeout)
        health = client.get("/health")
        client.llama = b is None and _is_llama(client)  # --url of a llama.cpp server: its prompt cache off too
        for method in methods:
            warm = client.chat([{"role": "user", "content": "Hello!"}], 8, method)  # builds the drafter
            label = method if len(args.batch or [0]) == 1 else f"{method} (batch {b})"
            arms.append(Arm(label, client, method, warm.tau is not None))
    if args.llama_server:
        arms.append(Arm("llama.cpp", Client(_start_llama(args, stack).url, timeout=args.request_timeout, llama=True),
                        None))
        arms[-1].client.chat([{"role": "user", "content": "Hello!"}], 8)
    return arms, health


def _is_llama(client: Client) -> bool:
    """Whether the server is llama.cpp's (its /props describes its generation settings)."""
    try:
        props = client.get("/props")
    except (OSError, ValueError, http.client.HTTPException):
        return False
    return isinstance(props, dict) and "default_generation_settings" in props


def _same_as(solo: dict[int, str], runs: list[dict]) -> str:
    """How many answers of every run equal the solo answer to the same prompt ("k/n"; greedy
    decoding is lossless under load when k = n)."""
    pairs = [(text, solo[i]) for r in runs for i, text in r["answers"].items() if i in solo]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle one of an even count), with how many ran."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return dict(ordered[(len(ordered) - 1) // 2], runs=len(runs),
                tokens_per_s_runs=[r["tokens_per_s"] for r in runs])


def median_interval(values: list[float], level: float = 0.95, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values``: the medians of ``rounds`` resamples drawn with
    replacement, their (1 - level) / 2 and (1 + level) / 2 quantiles (a fixed seed: the same figures
    give the same interval)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int((1 - level) / 2 * rounds)], medians[min(rounds - 1, int((1 + level) / 2 * rounds))]


POOLED_FROM = 6  # run pairs under load from which the report gives their pooled median an interval


def paired_ratios(arms: list[Arm], runs: dict, concurrency: list[int]) -> list[str]:
    """Speculation on / off per load: each method's tokens/s over vanilla's on the same server, run by
    run (the two ran back to back), the median of those ratios. With POOLED_FROM or more pairs at
    two or more clients, also their pooled median and a bootstrap 95% interval of it: whether this
    run can tell speculation under load from plain decoding, which one pair per load cannot on a
    machine whose speed drifts between runs."""
    lines = []
    for arm in arms:
        base = next((a for a in arms if a.client is arm.client and a.method == "vanilla"), None)
        if base is None or arm is base or arm.method is None:
            continue
        cells, loaded = [], []
        for c in concurrency:
            ratios = [on["tokens_per_s"] / off["tokens_per_s"] for on, off in zip(runs[(arm.label, c)],
                                                                                   runs[(base.label, c)])
                      if off["tokens_per_s"] > 0]
            cells.append(f"{statistics.median(ratios):.2f}x at {c}" if ratios else f"— at {c}")
            if c > 1:
                loaded += ratios
        lines.append(f"{arm.label} / {base.label}, tokens/s (median of run-by-run ratios): " + ", ".join(cells))
        if len(loaded) >= POOLED_FROM:
            lo, hi = median_interval(loaded)
            where = "above" if lo > 1 else "below" if hi < 1 else "on either side of"
            lines.append(f"{arm.label} / {base.label} under load ({', '.join(str(c) for c in concurrency if c > 1)} "
                         f"clients, {len(loaded)} run pairs): median {statistics.median(loaded):.3f}x, 95% interval "
                         f"of the median {lo:.3f}-{hi:.3f}x (bootstrap): {where} 1")
    return lines


def _start_llama(args: argparse.Namespace, stack: contextlib.ExitStack):
    """llama.cpp's server on the same GGUF (with --llama-server), closed with the stack."""
    from ddspec.bench.llama_server import LlamaServerArm, find_server
    from ddspec.models.loading import read_config, resolve_model_dir

    gguf = Path(args.model).expanduser()
    cfg = read_config(resolve_model_dir(str(gguf)))
    eos = cfg.get("eos_token_id")
    arm = LlamaServerArm(find_server(args.llama_server), gguf, tuple(eos if isinstance(eos, list) else [eos or 0]),
                         int(cfg.get("max_position_embeddings", 2048)), args.threads or 2, slots=args.slots)
    stack.callback(arm.close)
    return arm


def _start_server(args: argparse.Namespace, methods: list[str], batch: int = 1):
    """ddspec's server for the run (batch 0: `ddspec serve`'s default for this target)."""
    from ddspec.args import setup_torch, target_from_args, tree_from_args
    from ddspec.server.build import LiveServer, make_service
    from ddspec.server import default_batch

    setup_torch(args)
    target = target_from_args(args)
    service = make_service(target, method=methods[0], head=args.head, tree=tree_from_args(args),
                           max_queue=max(args.concurrency) + 1, batch=batch or default_batch(target))
    return LiveServer(service).start()


"""The commands: ``ddspec serve`` (a real process) and ``ddspec bench-serve`` (on a tiny model)."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="ddspec serve needs the 'serve' extra (fastapi, uvicorn, prometheus_client)")

from ddspec.cli import main  # noqa: E402
from ddspec.machine import free_port  # noqa: E402
from ddspec.server.cli import is_loopback  # noqa: E402


def wait_for_health(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "ddspec serve did not start"
        time.sleep(0.2)


def test_ddspec_serve_warns_off_loopback_without_a_key(tiny_dirs):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DDSPEC_API_KEY"}
    cmd = [sys.executable, "-m", "ddspec.cli", "serve", "--model", str(tiny_dirs["llama"]), "--method", "vanilla",
           "--host", "0.0.0.0", "--port", str(port), "--log-level", "warning", "--threads", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_health(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "abc", "max_tokens": 3}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "warning: listening on 0.0.0.0 without an API key" in err
    assert "pass --allow-host NAME" in err  # the Host allow-list is loopback names until told otherwise
    assert "Traceback" not in err


def test_ddspec_serve_takes_the_key_from_the_environment(tiny_dirs):
    port = free_port()
    env = {**os.environ, "DDSPEC_API_KEY": "from-env"}
    cmd = [sys.executable, "-m", "ddspec.cli", "serve", "--model", str(tiny_dirs["llama"]), "--method", "vanilla",
           "--port", str(port), "--log-level", "warning", "--threads", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for_health(port, proc)
        for key, status in ((None, 401), ("wrong", 401), ("from-env", 200)):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
            assert conn.getresponse().status == status
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "warning" not in err and "API key required" in err
    assert "up to 16 requests decoded together" in err  # the native target batches unless told otherwise


def test_serve_batches_by_default_where_the_target_can(tiny_dirs):
    """Without --batch the native target decodes up to AUTO_BATCH requests together; a target that
    cannot run several sequences in one forward (transformers') one at a time."""
    from ddspec.models.loading import load_target
    from ddspec.server import AUTO_BATCH, default_batch

    assert default_batch(load_target(str(tiny_dirs["llama"]), impl="native")) == AUTO_BATCH > 1
    assert default_batch(load_target(str(tiny_dirs["llama"]), impl="hf")) == 1


def test_user_errors_are_one_line(tiny_dirs, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    model = str(tiny_dirs["llama"])
    assert main(["serve", "--model", model, "--port", "0"]) == 2
    assert "--port must be in 1..65535" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--method", "ddd"]) == 2
    assert "needs a draft head" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--method", "ddd", "--head", "/no/such/head"]) == 2
    assert "/no/such/head" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--header-timeout", "0"]) == 2
    assert "--header-timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--max-connections", "1"]) == 2
    assert "--max-connections must be >= 2, got 1" in capsys.readouterr().err
    assert main(["serve", "--model", model, "--method", "vanilla", "--body-timeout", "-1"]) == 2
    assert "--body-timeout must be > 0 seconds, got -1.0" in capsys.readouterr().err
    assert main(["bench-serve", "--model", model, "--methods", "warp"]) == 2
    assert "unknown method 'warp'" in capsys.readouterr().err


def test_bench_serve_on_a_tiny_model(tiny_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "test", "turns": turns}) for i, turns in
                                 enumerate([["Tell me about the sea.", "Shorter."], ["Count to five."]])) + "\n")
    out = tmp_path / "bench"
    status = main(["bench-serve", "--model", str(tiny_dirs["llama"]), "--head", "random:1", "--methods",
                   "vanilla,eagle2@d3k2n4", "--concurrency", "1,3", "--requests", "3", "--max-tokens", "8",
                   "--chat-max-tokens", "40", "--reuse-trials", "2", "--prompts", str(prompts), "--out", str(out),
                   "--threads", "1", "--repeats", "2"])
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [
        ("vanilla", 1), ("vanilla", 3), ("eagle2@d3k2n4", 1), ("eagle2@d3k2n4", 3)]
    for r in rows:
        assert r["requests"] == 3 and r["errors"] == 0 and r["tokens_per_s"] > 0
        assert r["p99_latency_s"] >= r["p50_latency_s"] > 0 and r["requests_per_s"] > 0
        assert r["runs"] == 2 and min(r["tokens_per_s_runs"]) == r["tokens_per_s"]  # the lower middle of two
        assert r["same_as_solo"] == "6/6"  # greedy: every answer of every run equals the one-client answer
    reuse = results["reuse"]
    assert reuse["method"] == "eagle2@d3k2n4" and reuse["history_tokens"] > 60
    # the tiny tokenizer spells its <extra_N> tokens as text, so the history re-tokenizes differently
    # after the first one the model emits: only the common prefix (at least the first turn) is kept
    assert 20 < reuse["reused_tokens"] < reuse["history_tokens"]
    assert reuse["ttft_reuse_s"] > 0 and reuse["ttft_cold_s"] > 0
    summary = (out / "summary.md").read_text()
    assert "| vanilla | 3 | 3 |" in summary and "Third chat turn" in summary and "median of 2 runs" in summary
    assert "the server decoding up to 16 requests together" in summary  # serve's default on the native target
    assert "- eagle2@d3k2n4 / vanilla, tokens/s (median of run-by-run ratios): " in summary
    assert re.search(r"\d\.\d\dx at 1, \d+\.\d\dx at 3", summary)
    captured = capsys.readouterr()
    assert summary in captured.out
    # the arms take turns, in reverse order every other time (neither always runs after the other)
    order = re.findall(r"\[bench-serve\] (\S+) x1 \((\d)/2\)", captured.err)
    assert order == [("vanilla", "1"), ("eagle2@d3k2n4", "1"), ("eagle2@d3k2n4", "2"), ("vanilla", "2")]


def test_bench_serve_says_whether_its_runs_tell_speculation_under_load_from_plain():
    """The on / off ratio pooled over the runs under load, with a bootstrap interval of its median:
    a steady 10% loss is told apart from plain decoding, a spread to either side of 1 is not, one
    client's runs are left out, and too few pairs get no interval."""
    from ddspec.server.bench import Arm, median_interval, paired_ratios

    server = object()
    arms = [Arm("vanilla", server, "vanilla"), Arm("ddspec", server, "ddspec")]

    def runs(on_by_load):
        return {**{("vanilla", c): [{"tokens_per_s": 100.0}] * len(v) for c, v in on_by_load.items()},
                **{("ddspec", c): [{"tokens_per_s": x} for x in v] for c, v in on_by_load.items()}}

    slower = paired_ratios(arms, runs({1: [130.0] * 3, 4: [89.0, 91.0, 90.0], 16: [88.0, 92.0, 90.0]}), [1, 4, 16])
    assert slower[0] == "ddspec / vanilla, tokens/s (median of run-by-run ratios): 1.30x at 1, 0.90x at 4, 0.90x at 16"
    assert slower[1].startswith("ddspec / vanilla under load (4, 16 clients, 6 run pairs): median 0.900x, 95% interval")
    assert slower[1].endswith(": below 1")
    noisy = paired_ratios(arms, runs({4: [85.0, 112.0, 97.0, 104.0], 16: [93.0, 108.0, 99.0, 101.0]}), [4, 16])
    assert noisy[1].endswith(": on either side of 1") and "8 run pairs" in noisy[1]
    assert len(paired_ratios(arms, runs({1: [90.0] * 9, 4: [90.0] * 5}), [1, 4])) == 1  # 5 pairs under load
    lo, hi = median_interval([0.9, 1.1, 0.95, 1.05, 1.0, 0.97])
    assert lo <= 0.985 <= hi and (lo, hi) == median_interval([0.9, 1.1, 0.95, 1.05, 1.0, 0.97])
    assert median_interval([2.0] * 7) == (2.0, 2.0)


class OpenAIStandIn(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that is not ddspec, for bench-serve's --url: /health answers ok,
    subclasses answer POSTs (``stream`` sends chat chunks without usage)."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_json({"status": "ok"})

    def send_json(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def stream(self, pieces):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in pieces:
            self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def serve_in_thread(handler) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_bench_serve_measures_another_openai_server(tmp_path, capsys):
    """--url of an OpenAI-compatible server that is not ddspec (llama.cpp's server streams no ddspec
    usage fields, and its /health names no model): its tokens are counted from the stream, τ is
    reported as unknown and the prefix-reuse chat is skipped, with a line saying so. Its load requests
    ask for the whole prompt to be prefilled (ddspec's field) and carry no llama.cpp field."""
    bodies = []

    class Foreign(OpenAIStandIn):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.stream(("It", " is", " blue", "."))

    server = serve_in_thread(Foreign)
    try:
        out = tmp_path / "bench"
        status = main(["bench-serve", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--methods", "vanilla",
                       "--concurrency", "1,2", "--requests", "3", "--max-tokens", "8", "--reuse-trials", "1",
                       "--out", str(out)])
    finally:
        server.shutdown()
    assert status == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["requests"], r["errors"], r["tau"], r["same_as_solo"]) for r in rows] == [(3, 0, None, None)] * 2
    assert all(r["tokens_per_s"] > 0 for r in rows)
    captured = capsys.readouterr()
    assert "the reuse chat is skipped" in captured.err and "| vanilla | 2 | 3 |" in captured.out
    load = [b for b in bodies if b["messages"][0]["content"] != "Hello!"]  # (the warm-up's)
    assert len(load) == 6 and all(b["ddspec"]["prefix_reuse"] is False and "cache_prompt" not in b for b in load)


def test_bench_serve_turns_a_llama_cpp_url_s_prompt_cache_off(tmp_path, capsys):
    """--url of a server that describes itself as llama.cpp's (/props): its load requests carry
    llama.cpp's own field for a full prefill, as those of the llama.cpp arm do."""
    bodies = []

    class Llama(OpenAIStandIn):
        def do_GET(self):
            if self.path != "/props":
                return super().do_GET()
            self.send_json({"default_generation_settings": {"n_ctx": 2048}})

        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.stream(("a",))

    server = serve_in_thread(Llama)
    try:
        status = main(["bench-serve", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--methods", "vanilla",
                       "--concurrency", "2", "--requests", "2", "--max-tokens", "4", "--reuse-trials", "0"])
    finally:
        server.shutdown()
    assert status == 0
    load = [b for b in bodies if b["messages"][0]["content"] != "Hello!"]
    assert len(load) == 2 and all(b["cache_prompt"] is False for b in load)


def test_bench_serve_reports_a_stuck_server_as_errors_and_keeps_each_completed_level(tmp_path, capsys):
    """A server that stops answering costs one request its --request-timeout and gives an error in its
    row, not a hang; the levels measured before it are already in --out when the next one starts."""
    out, seen, partial = tmp_path / "bench", [], []

    class Stuck(OpenAIStandIn):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(1)
            if len(seen) == 4:  # a warm-up, 2 at the first load level, then the first at the second: stall
                partial.append(json.loads((out / "results.json").read_text()))
                partial.append((out / "summary.md").read_text())
                time.sleep(3)
                return
            self.stream(("x",))

    server = serve_in_thread(Stuck)
    try:
        status = main(["bench-serve", "--url", f"http://127.0.0.1:{server.server_address[1]}", "--methods", "vanilla",
                       "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4", "--reuse-trials", "0",
                       "--request-timeout", "1", "--out", str(out)])
    finally:
        server.shutdown()
    assert status == 1  # a row with errors
    assert partial[0]["complete"] is False and [r["concurrency"] for r in partial[0]["rows"]] == [1]
    final = json.loads((out / "results.json").read_text())
    assert final["complete"] is True
    assert [(r["requests"], r["errors"]) for r in final["rows"]] == [(2, 0), (1, 1)]
    assert "timed out" in final["rows"][1]["first_error"]
    assert "incomplete: concurrency 1 measured so far" in partial[1]
    assert "incomplete" not in (out / "summary.md").read_text()


FAKE_LLAMA = r'''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("-np") + 1] == "4" and args[args.index("-m") + 1].endswith(".gguf")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        body = json.dumps({{"status": "ok"}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v1/chat/completions" and req["stream"] and req["temperature"] == 0
        # the load requests (6 tokens; the warm-up asks for 8) turn its prompt cache off: the runs
        # repeat the same prompts, which its slots would otherwise still hold
        assert req["cache_prompt"] is (req["max_tokens"] != 6)
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        for piece in ["a"] * min(req["max_tokens"], 5):
            self.wfile.write(("data: " + json.dumps({{"choices": [{{"delta": {{"content": piece}}}}]}}) + "\n\n").encode())
        usage = {{"completion_tokens": min(req["max_tokens"], 5), "prompt_tokens": 9}}
        self.wfile.write(("data: " + json.dumps({{"choices": [], "usage": usage}}) + "\n\n").encode())
        self.wfile.write(b"data: [DONE]\n\n")
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_bench_serve_measures_llama_cpps_server_in_the_same_run(tmp_path, capsys):
    from test_gguf_convert import write_tiny_llama

    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama(gguf, {"embd": 8, "attn": 8, "ffn": 8, "norm": 0})  # Q8_0 weights, F32 norms
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "bench"
    status = main(["bench-serve", "--model", str(gguf), "--methods", "vanilla", "--concurrency", "1,2",
                   "--requests", "2", "--max-tokens", "6", "--reuse-trials", "0", "--threads", "1",
                   "--activations", "int8", "--llama-server", str(fake), "--slots", "4", "--out", str(out)])
    assert status == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["method"], r["concurrency"]) for r in rows] == [("vanilla", 1), ("vanilla", 2), ("llama.cpp", 1),
                                                               ("llama.cpp", 2)]
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in rows)
    assert [r["tau"] for r in rows[2:]] == [None, None]
    assert main(["bench-serve", "--model", "default", "--methods", "vanilla", "--llama-server", str(fake)]) == 2
    assert "--model FILE.gguf" in capsys.readouterr().err

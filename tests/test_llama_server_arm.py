"""The llama.cpp arm on a llama-server binary: started, asked for prompt ids, timed by its own report.

A stand-in server (a few lines of Python that answer as llama-server does) checks the protocol; the
real binary is measured by `ddspec bench --llama-server PATH` (docs/benchmarks.md), outside the tests."""

from __future__ import annotations

import os
import sys

import pytest

from ddspec.bench.llama_server import LlamaServerArm, find_server
from ddspec.errors import DdspecError

FAKE = r'''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("-t") + 1] == "2" and args[args.index("-np") + 1] == "1"
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {{"status": "ok"}})
    def do_POST(self):
        sys.stderr.write("x" * 100000 + "\nserved " + self.path + "\n")  # llama-server logs every request
        sys.stderr.flush()
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["cache_prompt"] is False and req["temperature"] == 0.0 and req["return_tokens"] is True
        prompt = req["prompt"]
        if prompt[0] == 7:  # stops on EOS (llama-server leaves the EOS token out of `tokens`)
            self._send(200, {{"tokens": [5, 6], "stop_type": "eos", "timings": {{"prompt_ms": 10.0, "predicted_ms": 20.0}}}})
        else:
            n = req["n_predict"]
            self._send(200, {{"tokens": list(range(100, 100 + n)), "stop_type": "limit",
                             "timings": {{"prompt_ms": 4.0, "predicted_ms": 2.0 * n, "predicted_n": n}}}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_the_arm_sends_prompt_ids_and_reads_llama_cpps_own_timings(fake_server, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    # a log larger than a pipe holds must not stall the server (it did, once 16 slots had logged 64 KiB)
    arm = LlamaServerArm(fake_server, gguf, eos_ids=(2,), max_position=64, threads=2, request_timeout=20.0)
    try:
        plain = arm.generate([1, 2, 3], max_new_tokens=5)
        assert plain.output_ids == [100, 101, 102, 103, 104] and plain.finish_reason == "length"
        assert plain.wall_s == pytest.approx(0.014)
        assert plain.decoding == (5, pytest.approx(0.010))  # its decoding alone, as it reports it
        stopped = arm.generate([7, 8], max_new_tokens=5)
        assert stopped.output_ids == [5, 6, 2] and stopped.finish_reason == "eos"  # EOS counted, as every arm does
        assert stopped.wall_s == pytest.approx(0.030) and stopped.decoding is None  # no predicted_n: not reported
        assert len(arm.generate(list(range(60)), max_new_tokens=50).output_ids) == 4  # the context window's budget
        assert arm.log_tail(1) == ["served /completion"]
    finally:
        arm.close()
    assert arm.proc.poll() is not None


def test_decoding_alone_is_reported_beside_the_rate_with_prefill():
    from ddspec.bench.report import decoding_rate, method_metrics

    ours = {"new_tokens": 11, "wall_time": 0.2, "decode_tokens": 10, "decode_ms": 100.0, "output_ids": [1] * 11,
            "accept_lengths": [], "tree_sizes": [], "decoding_steps": None}
    theirs = dict(ours, decode_tokens=11, decode_ms=50.0)
    assert decoding_rate([ours]) == pytest.approx(100.0) and decoding_rate([theirs]) == pytest.approx(220.0)
    assert decoding_rate([dict(ours, decode_ms=None)]) is None  # an arm that does not report it
    row = method_metrics([ours, ours], None, greedy=True)
    assert row["tokens_per_s"] == pytest.approx(55.0) and row["decode_tokens_per_s"] == pytest.approx(100.0)


def test_a_bad_server_path_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("DDSPEC_LLAMA_SERVER", raising=False)
    with pytest.raises(DdspecError, match="not an executable file"):
        find_server(str(tmp_path / "nowhere"))
    monkeypatch.setenv("DDSPEC_LLAMA_SERVER", str(tmp_path / "nowhere"))
    with pytest.raises(DdspecError, match="DDSPEC|not an executable file"):
        find_server()
    monkeypatch.delenv("DDSPEC_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_server() is None
    assert os.environ["PATH"] == str(tmp_path)


def test_llama_cpps_speculation_arms(fake_server, tmp_path, tiny_targets):
    """llama.cpp@draft starts llama-server with the draft model (-md), llama.cpp@ngram with its n-gram
    lookup; the method names are checked before any model loads."""
    from ddspec.bench.runner import llama_cpp_arm, parse_methods
    from ddspec.config import SamplingConfig, TreeConfig

    gguf, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    for f in (gguf, draft):
        f.write_bytes(b"GGUF")
    with_draft = TreeConfig(draft_model=str(draft))
    assert parse_methods("vanilla,llama.cpp,llama.cpp@ngram,llama.cpp@draft", with_draft)[1:] == [
        "llama.cpp", "llama.cpp@ngram", "llama.cpp@draft"]
    with pytest.raises(DdspecError, match="--draft-model"):
        parse_methods("llama.cpp@draft")
    with pytest.raises(DdspecError, match="unknown method"):
        parse_methods("llama.cpp@lookahead")
    target = tiny_targets[("llama", "native")]
    for mode, flags in (("draft", ["-md", str(draft)]), ("ngram", ["--spec-type", "ngram-simple"])):
        arm = llama_cpp_arm(target, str(gguf), SamplingConfig(), 2, str(fake_server), mode, str(draft))
        try:
            args = arm.proc.args
            assert args[-len(flags):] == flags and arm.generate([1, 2], 3).output_ids == [100, 101, 102]
        finally:
            arm.close()

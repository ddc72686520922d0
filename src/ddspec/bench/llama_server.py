"""The ``llama.cpp`` arm on llama.cpp's own server binary, as its users run it.

llama-cpp-python's Python loop costs llama.cpp about a quarter of its speed (AMD EPYC family 25
model 1: 49.7 against 63.2 tokens/s including prefill on 52 chat prompts, same build, same prompt
ids), so ``ddspec bench`` prefers ``llama-server`` when it can find one: ``--llama-server PATH``,
else ``$DDSPEC_LLAMA_SERVER``, else ``llama-server`` on the PATH. It starts one server with one
slot on the same GGUF and thread count, sends each prompt's token ids to ``/completion`` (greedy,
no prompt cache, so every generation prefills its whole prompt as the other arms do) and takes
the time from llama.cpp's own report (``timings.prompt_ms + timings.predicted_ms``: its prefill
and decoding, without the HTTP round trip). Build it as docs/benchmarks.md says.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from ddspec.bench.generation import Generation
from ddspec.errors import DdspecError
from ddspec.machine import free_port

SERVER_ENV = "DDSPEC_LLAMA_SERVER"


def find_server(explicit: str | None = None) -> Path | None:
    """The llama-server binary: ``explicit``, else $DDSPEC_LLAMA_SERVER, else on the PATH; None if none."""
    for candidate in (explicit, os.environ.get(SERVER_ENV)):
        if candidate:
            path = Path(candidate).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise DdspecError(f"llama-server {candidate} is not an executable file: give the path of the "
                                  "llama-server binary of a llama.cpp build (docs/benchmarks.md)")
            return path
    found = shutil.which("llama-server")
    return Path(found) if found else None


class LlamaServerArm:
    """One llama-server process (one slot unless ``slots``: each slot its own context of up to 8,192
    tokens); ``generate`` sends prompt ids and returns llama.cpp's ids, ``url`` serves any client
    (``ddspec bench-serve``'s)."""

    def __init__(self, binary: Path, gguf: Path, eos_ids: tuple[int, ...], max_position: int, threads: int,
                 start_timeout: float = 120.0, slots: int = 1, extra_args: tuple[str, ...] = (),
                 request_timeout: float = 600.0) -> None:
        """extra_args: more llama-server flags (its speculative decoding: ``-md DRAFT.gguf``, ``--spec-type
        ngram-simple``; see :data:`ddspec.bench.runner.LLAMA_CPP_MODES`); request_timeout: seconds a
        generation may take before it is reported as an error."""
        self.eos_ids, self.max_position, self.request_timeout = set(eos_ids), max_position, request_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        ctx = min(max_position, 8192)
        # its log goes to a file, never to a pipe: llama-server logs every request, and once a pipe
        # nobody reads is full (64 KiB: about a hundred requests) its next log line blocks
        # the server, and every client waits forever
        self.log = tempfile.TemporaryFile(mode="w+", prefix="llama-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx * slots),
             "-np", str(slots), "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *extra_args],
            stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        atexit.register(self.close)  # never leave a server behind, whatever ends the bench
        deadline = time.monotonic() + start_timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                err = self.log_tail(3)
                raise DdspecError(f"llama-server exited with code {self.proc.returncode}: {' | '.join(err)}")
            if time.monotonic() > deadline:
                self.close()
                raise DdspecError(f"llama-server did not become ready within {start_timeout:.0f} s")
            time.sleep(0.2)

    def log_tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines the server logged."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().strip().splitlines()[-lines:]

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body)
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"{}")
        finally:
            conn.close()

    def _healthy(self) -> bool:
        try:
            return self._request("GET", "/health", timeout=2.0)[0] == 200
        except (OSError, ValueError):
            return False

    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        budget = min(max_new_tokens, self.max_position - len(prompt_ids))
        status, out = self._request("POST", "/completion", {
            "prompt": list(prompt_ids), "n_predict": budget, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
            "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "stream": False},
            timeout=self.request_timeout)
        if status != 200:
            raise DdspecError(f"llama-server answered {status}: {out.get('error', out)}")
        ids = [int(t) for t in out.get("tokens", [])]
        finish = "eos" if out.get("stop_type") == "eos" else "length"
        if finish == "eos" and (not ids or ids[-1] not in self.eos_ids):
            ids.append(min(self.eos_ids))  # EOS counts as a generated token, as in every other arm
        timings = out.get("timings", {})
        wall = (float(timings.get("prompt_ms", 0.0)) + float(timings.get("predicted_ms", 0.0))) / 1000.0
        decoding = None
        if timings.get("predicted_n") and timings.get("predicted_ms"):  # its own decoding alone
            decoding = (int(timings["predicted_n"]), float(timings["predicted_ms"]) / 1000.0)
        return Generation(ids, wall, finish, None, decoding)

    def close(self) -> None:
        if getattr(self, "proc", None) is None:  # its start failed
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __del__(self) -> None:
        self.close()

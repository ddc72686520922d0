"""ddspec serve: the OpenAI API against a live server on loopback (tiny random models).

One server per module (a fixture), reached through the official ``openai`` client and through
raw HTTP for the malformed requests a client library would not send. Greedy outputs are compared
with the engine's own ``generate`` on a separately loaded copy of the same model.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="ddspec serve needs the 'serve' extra (fastapi, uvicorn, prometheus_client)")
openai = pytest.importorskip("openai", reason="the server tests use the official openai client")

from ddspec.config import SamplingConfig, StopConfig, TreeConfig  # noqa: E402
from ddspec.engine import Engine  # noqa: E402
from ddspec.models.loading import load_target  # noqa: E402
from ddspec.prompts import chat_prompt_ids  # noqa: E402
from ddspec.server.build import LiveServer, make_service  # noqa: E402

TREE = TreeConfig(top_k=4, depth=4, total_tokens=12)
PROMPTS = ["Hello there!", "Write a poem about the sea.", "What is 2 + 2?", "List three colours."]


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_dirs):
    return tiny_dirs["llama"]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Plain decoding on its own copy of the model: what every greedy answer must equal."""
    target = load_target(str(tiny_dir), impl="native")

    def generate(ids: list[int], max_tokens: int, stop: tuple[str, ...] = (), sampling=SamplingConfig()):
        return Engine(target, sampling=sampling).generate(ids, StopConfig(max_new_tokens=max_tokens,
                                                                          stop_strings=stop))

    generate.tokenizer = target.tokenizer
    return generate


def start(tiny_dir, **kwargs) -> LiveServer:
    target = load_target(str(tiny_dir), impl="native")
    options = dict(method="eagle2", head="random:1", tree=TREE, max_tokens=32)
    return LiveServer(make_service(target, **{**options, **kwargs})).start()


@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def live(tiny_dir, request):
    # room for the load test's 16 clients plus the cancelled streams the worker has not dropped yet
    # (the queue bound itself: test_queue_bound_answers_429_with_retry_after, on its own server);
    # every test runs on a server decoding one request at a time and on one decoding 4 together
    server = start(tiny_dir, max_body_bytes=64 * 1024, max_queue=32, batch=request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(api_key="unused", base_url=live.url + "/v1", max_retries=0, timeout=60)


def model_of(live) -> str:
    return live.service.config.model_name


def raw(live, method: str, path: str, body: bytes | str | dict | None = None,
        headers: dict | None = None) -> tuple[int, dict, dict | str]:
    """One raw HTTP request: (status, headers, JSON body or text)."""
    conn = http.client.HTTPConnection(live.host, live.port, timeout=60)
    try:
        data = json.dumps(body) if isinstance(body, dict) else body
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            payload = text
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload
    finally:
        conn.close()


def chat_ids(reference, messages) -> list[int]:
    return chat_prompt_ids(reference.tokenizer, messages)


def wait_idle(live, timeout: float = 10.0) -> float:
    t0 = time.perf_counter()
    while live.service.worker.depth or live.service.worker.busy:
        assert time.perf_counter() - t0 < timeout, "the engine did not become free"
        time.sleep(0.01)
    return time.perf_counter() - t0


# -- the API through the openai client ------------------------------------------------------
def test_models_and_health(live, client):
    assert [m.id for m in client.models.list().data] == [model_of(live)]
    assert client.models.retrieve(model_of(live)).id == model_of(live)
    status, _, body = raw(live, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["method"] == "eagle2"
    assert body["context_window"] == 512 and "vanilla" in body["methods"]
    assert body["batch"] == live.service.worker.batch in (1, 4)  # the fixture's servers: 1 and 4 together


@pytest.mark.parametrize("method", [None, "vanilla", "chain", "eagle"])
def test_chat_equals_generate(live, client, reference, method):
    for prompt in PROMPTS[:2]:
        messages = [{"role": "user", "content": prompt}]
        extra = {"ddspec": {"method": method}} if method else None
        r = client.chat.completions.create(model=model_of(live), messages=messages, max_tokens=24, extra_body=extra)
        ref = reference(chat_ids(reference, messages), 24)
        assert r.choices[0].message.content == ref.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == {"eos": "stop", "length": "length"}[ref.stats.finish_reason]
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(chat_ids(reference, messages))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        extra_usage = r.usage.model_extra["ddspec"]
        assert extra_usage["method"] == (method or "eagle2")
        assert extra_usage["tau"] >= 1 and extra_usage["steps"] >= 1
        assert extra_usage["draft_ms"] >= 0 and extra_usage["verify_ms"] > 0


def test_drafters_per_method_are_bounded(live, client, reference):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ref = reference(chat_ids(reference, messages), 6).text
    for k in range(1, 11):  # ten sized methods: ten drafters, of which at most MAX_DRAFTERS stay built
        extra = {"ddspec": {"method": f"eagle2@d2k2n{k + 1}"}}
        r = client.chat.completions.create(model=model_of(live), messages=messages, max_tokens=6, extra_body=extra)
        assert r.choices[0].message.content == ref
    from ddspec.server.worker import MAX_DRAFTERS

    kept = live.service.worker._drafters
    assert len(kept) == MAX_DRAFTERS and "eagle2" in kept and "eagle2@d2k2n11" in kept


def test_chat_streaming_equals_generate(live, client, reference):
    for prompt in PROMPTS:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        stream = client.chat.completions.create(model=model_of(live), messages=messages, max_tokens=30, stream=True,
                                                stream_options={"include_usage": True})
        pieces, finish, usage, roles = [], None, None, []
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
                assert chunk.choices == []
                continue
            delta = chunk.choices[0].delta
            roles += [delta.role] if delta.role else []
            pieces += [delta.content] if delta.content else []
            finish = chunk.choices[0].finish_reason or finish
        ref = reference(chat_ids(reference, messages), 30)
        assert "".join(pieces) == ref.text
        assert roles == ["assistant"] and finish in ("stop", "length")
        assert usage.completion_tokens == len(ref.token_ids)
        assert usage.model_extra["ddspec"]["method"] == "eagle2"


def test_streaming_without_usage_sends_none(live, client):
    stream = client.chat.completions.create(model=model_of(live), messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stream=True)
    assert all(chunk.usage is None for chunk in stream)


def test_completions_equal_generate(live, client, reference):
    for prompt in PROMPTS[:3]:
        r = client.completions.create(model=model_of(live), prompt=prompt, max_tokens=20)
        ref = reference(reference.tokenizer.encode(prompt), 20)
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == len(ref.token_ids)
        stream = client.completions.create(model=model_of(live), prompt=prompt, max_tokens=20, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text
    ids = reference.tokenizer.encode(PROMPTS[3])
    r = client.completions.create(model=model_of(live), prompt=ids, max_tokens=12)
    assert r.choices[0].text == reference(ids, 12).text


def test_stop_strings_and_max_completion_tokens(live, client, reference):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    full = reference(chat_ids(reference, messages), 30).text
    stop = full[5:7]  # a piece of the greedy answer: the answer must end right before its first occurrence
    r = client.chat.completions.create(model=model_of(live), messages=messages, max_completion_tokens=30, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].message.content == reference(chat_ids(reference, messages), 30, (stop,)).text


def test_seeded_sampling_is_reproducible_and_equals_the_engine(live, client, reference):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    kwargs = dict(model=model_of(live), messages=messages, max_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b  # a seed fixes the draws (speculative sampling draws differently from plain decoding)
    plain = client.chat.completions.create(**kwargs, extra_body={"ddspec": {"method": "vanilla"}})
    ref = reference(chat_ids(reference, messages), 20, sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=7))
    assert plain.choices[0].message.content == ref.text


def test_three_turn_chat_reuses_the_prefix(live, client, reference):
    history, previous_prompt = [], 0
    for turn, text in enumerate(["Tell me about the sea.", "Shorter, please.", "And mountains?"]):
        history.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=model_of(live), messages=history, max_tokens=20)
        answer = r.choices[0].message.content
        assert answer == reference(chat_ids(reference, history), 20).text
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (turn > 0), (turn, cached)
        if turn:
            assert cached >= previous_prompt - 1  # the whole previous prompt (the head keeps one less)
        previous_prompt = r.usage.prompt_tokens
        history.append({"role": "assistant", "content": answer})
    off = client.chat.completions.create(model=model_of(live), messages=history[:-1], max_tokens=20,
                                         extra_body={"ddspec": {"prefix_reuse": False}})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].message.content == history[-1]["content"]


def test_trace_streams_each_steps_tree(live):
    body = {"model": model_of(live), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
            "stream": True, "ddspec": {"trace": True}}
    status, _, text = raw(live, "POST", "/v1/chat/completions", body)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    trees = [e["ddspec"]["tree"] for e in events if "tree" in e.get("ddspec", {})]
    assert trees and events[-1]["usage"]["ddspec"]["steps"] == len(trees)
    for tree in trees:
        n = len(tree["tokens"])
        assert n == TREE.total_tokens and len(tree["parents"]) == len(tree["texts"]) == len(tree["scores"]) == n
        assert tree["parents"][0] == -1 and all(0 <= p < i for i, p in enumerate(tree["parents"]) if i)
        assert tree["path"][0] == 0 and all(tree["parents"][b] == a for a, b in zip(tree["path"], tree["path"][1:]))


# -- bad input: status codes and messages ----------------------------------------------------
def error_of(payload) -> str:
    assert isinstance(payload, dict) and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    return payload["error"]["message"]


def chat_body(live, **extra) -> dict:
    return {"model": model_of(live), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize("body, status, pattern", [
    (b"{not json", 400, r"not valid JSON"),
    (b"[1, 2]", 400, r"must be a JSON object, got list"),
    (b"\xff\xfe", 400, r"not valid JSON"),
    (b"[" * 60_000, 400, r"not valid JSON: nested too deeply"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, r"NaN is not a JSON value"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, 400, r"seed: Input should be less than"),
    ({"messages": "hello"}, 400, r"messages"),
    ({"messages": []}, 400, r"messages: List should have at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, r"messages\.0\.role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, r"messages\.0\.content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, r"temperature.*valid number"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, r"temperature.*less than or equal to 2"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, r"max_tokens.*greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}, 400, r"max_tokens.*valid integer"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, r"stream.*valid boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, r"unsupported parameter\(s\): n \(one choice"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, r"unsupported parameter\(s\): logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "n": 3, "top_logprobs": 2}, 400, r"unsupported parameter\(s\): n .*, top_logprobs, tools"),
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, r"unrecognized request argument.*frobnicate"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, 400, r"at most 4"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 5}, 400, r"disagree"),
    ({"messages": [{"role": "user", "content": "x"}], "ddspec": {"method": "magic"}}, 400, r"unknown method 'magic'"),
    ({"messages": [{"role": "user", "content": "x"}], "ddspec": {"turbo": True}}, 400, r"ddspec\.turbo"),
    ({"messages": [{"role": "user", "content": "x"}], "ddspec": {"method": "eagle2@d99"}}, 400, r"at most depth 16"),
])
def test_bad_chat_requests(live, body, status, pattern):
    got, _, payload = raw(live, "POST", "/v1/chat/completions", body)
    assert got == status, payload
    assert re.search(pattern, error_of(payload)), error_of(payload)


def test_bad_completion_requests(live):
    for body, pattern in [({"prompt": ["a", "b"]}, r"one prompt per request"), ({"prompt": ""}, r"prompt is empty"),
                          ({"prompt": [1, 99999]}, r"token ids must be in \[0, 128\)"),
                          ({"prompt": "x", "echo": True, "best_of": 2}, r"best_of .*echo")]:
        status, _, payload = raw(live, "POST", "/v1/completions", {"model": model_of(live), **body})
        assert status == 400 and re.search(pattern, error_of(payload)), payload


def test_unknown_model_is_404_as_openai_answers(live, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["code"] == "model_not_found" and "`gpt-9` does not exist" in e.value.body["message"]
    status, _, payload = raw(live, "GET", "/v1/models/gpt-9")
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    status, _, payload = raw(live, "GET", "/no/such/page")
    assert status == 404 and error_of(payload) == "Not Found"


def test_context_overflow_names_both_numbers(live, client):
    window = 512
    long_prompt = "word " * 200  # 1,000 characters = tokens of the character-level tiny tokenizer
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(live), prompt=long_prompt, max_tokens=4)
    message = e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded"
    assert f"{window - (TREE.depth - 1)} tokens" in message and "1000 tokens" in message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(live), prompt="x" * 300, max_tokens=400)
    assert re.search(r"you requested 700 tokens \(300 in the prompt, 400 for the completion\)", e.value.body["message"])
    r = client.completions.create(model=model_of(live), prompt="x" * 300, max_tokens=4,
                                  extra_body={"ddspec": {"method": "vanilla"}})
    assert r.usage.prompt_tokens == 300
    for method, room in (("eagle2", TREE.depth - 1), ("ddd", TREE.max_depth - 1), ("vanilla", 0)):
        # right at the limit: the deepest draft still fits the window (no error, every token generated)
        r = client.completions.create(model=model_of(live), prompt="y" * 480, max_tokens=window - room - 480,
                                      extra_body={"ddspec": {"method": method}})
        assert r.usage.completion_tokens == window - room - 480 or r.choices[0].finish_reason == "stop"


def test_oversized_body_is_413(live):
    body = json.dumps(chat_body(live, messages=[{"role": "user", "content": "x" * 70_000}]))
    status, _, payload = raw(live, "POST", "/v1/chat/completions", body)
    assert status == 413 and "65536" in error_of(payload)


def test_server_is_sound_after_bad_input(live, client, reference):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    r = client.chat.completions.create(model=model_of(live), messages=messages, max_tokens=24)
    assert r.choices[0].message.content == reference(chat_ids(reference, messages), 24).text
    assert raw(live, "GET", "/health")[0] == 200


# -- cancellation, the queue bound, metrics ---------------------------------------------------
def test_disconnect_mid_stream_frees_the_engine(live, client, reference):
    wait_idle(live)
    stream = client.completions.create(model=model_of(live), prompt="abc", max_tokens=450, stream=True,
                                       extra_body={"ddspec": {"method": "vanilla"}})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    assert wait_idle(live, timeout=5) < 2.0  # 450 tokens take several seconds: it stopped early
    text = client.completions.create(model=model_of(live), prompt="abc", max_tokens=10).choices[0].text
    assert text == reference(reference.tokenizer.encode("abc"), 10).text


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_engine(live):
    wait_idle(live)
    # a short client timeout: 450 tokens of the tiny model take well over 50 ms even on the C kernels
    conn = http.client.HTTPConnection(live.host, live.port, timeout=0.05)
    body = {"model": model_of(live), "prompt": "abc", "max_tokens": 450, "ddspec": {"method": "vanilla"}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    with pytest.raises(TimeoutError):
        conn.getresponse()
    assert live.service.worker.busy  # generating...
    conn.close()  # ... for a client that is gone
    assert wait_idle(live, timeout=5) < 2.0


def test_queue_bound_answers_429_with_retry_after(tiny_dir):
    server = start(tiny_dir, max_queue=1, method="vanilla")
    try:
        client = openai.OpenAI(api_key="x", base_url=server.url + "/v1", max_retries=0, timeout=60)
        stream = client.completions.create(model=model_of(server), prompt="abc", max_tokens=400, stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=model_of(server), prompt="abc", max_tokens=4)
        assert int(e.value.response.headers["retry-after"]) >= 1
        assert e.value.body["code"] == "queue_full" and "at most 1" in e.value.body["message"]
        stream.close()
        wait_idle(server)
        assert client.completions.create(model=model_of(server), prompt="abc", max_tokens=4).choices[0].text
    finally:
        server.stop()


def test_metrics(live, client):
    client.chat.completions.create(model=model_of(live), messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    status, headers, text = raw(live, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("ddspec_requests_total", "ddspec_generated_tokens_total", "ddspec_tau_bucket",
                 "ddspec_step_draft_seconds_bucket", "ddspec_step_verify_seconds_bucket", "ddspec_queue_depth",
                 "ddspec_time_to_first_token_seconds_bucket", "ddspec_prompt_tokens_total"):
        assert re.search(rf"^{name}", text, re.M), name
    assert re.search(r'^ddspec_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text, re.M)
    assert re.search(r'^ddspec_requests_total\{endpoint="/v1/chat/completions",status="400"\} [1-9]', text, re.M)
    assert re.search(r"^ddspec_queue_depth 0\.0$", text, re.M)


# -- API key -------------------------------------------------------------------------------
def test_api_key(tiny_dir):
    server = start(tiny_dir, api_key="s3cret", method="vanilla")
    try:
        body = {"model": model_of(server), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        for path, method in [("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/metrics", "GET")]:
            status, _, payload = raw(server, method, path, body if method == "POST" else None)
            assert status == 401 and "didn't provide an API key" in error_of(payload)
            status, _, payload = raw(server, method, path, body if method == "POST" else None,
                                     {"Authorization": "Bearer wrong"})
            assert status == 401 and error_of(payload) == "Incorrect API key provided."
            assert payload["error"]["code"] == "invalid_api_key"
            assert raw(server, method, path, body if method == "POST" else None,
                       {"Authorization": "Bearer s3cret"})[0] == 200
        assert raw(server, "GET", "/health")[0] == 200 and raw(server, "GET", "/")[0] == 200  # hold no data
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="nope", base_url=server.url + "/v1", max_retries=0).models.list()
        good = openai.OpenAI(api_key="s3cret", base_url=server.url + "/v1", max_retries=0)
        assert good.chat.completions.create(**body).choices[0].message.content is not None
    finally:
        server.stop()


# -- load ----------------------------------------------------------------------------------
def test_load_16_clients_mixed_and_cancelled(live, reference):
    """16 concurrent clients x 3 requests: streaming and not, every third one cancelled mid-stream."""
    prompts = [f"Question {i}: {p}" for i, p in enumerate(PROMPTS * 2)]
    expected = {p: reference(chat_ids(reference, [{"role": "user", "content": p}]), 16).text for p in prompts}
    wait_idle(live)
    results, failures = [], []
    lock = threading.Lock()

    def client_thread(k: int):
        c = openai.OpenAI(api_key="x", base_url=live.url + "/v1", max_retries=0, timeout=120)
        for j in range(3):
            prompt = prompts[(k + j) % len(prompts)]
            messages = [{"role": "user", "content": prompt}]
            try:
                if (k + j) % 3 == 0:  # cancelled mid-stream
                    s = c.chat.completions.create(model=model_of(live), messages=messages, max_tokens=200, stream=True)
                    for n, _ in enumerate(s):
                        if n == 2:
                            break
                    s.close()
                    continue
                if (k + j) % 3 == 1:
                    s = c.chat.completions.create(model=model_of(live), messages=messages, max_tokens=16, stream=True)
                    text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
                else:
                    r = c.chat.completions.create(model=model_of(live), messages=messages, max_tokens=16)
                    text = r.choices[0].message.content
                with lock:
                    results.append((prompt, text))
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                with lock:
                    failures.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    elapsed = time.perf_counter() - t0
    assert not any(t.is_alive() for t in threads) and elapsed < 180
    assert failures == []
    assert len(results) == 32
    assert all(text == expected[prompt] for prompt, text in results)
    wait_idle(live)
    status, _, health = raw(live, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["queue_depth"] == 0
    _, _, text = raw(live, "GET", "/metrics")
    assert not re.search(r'status="5\d\d"', text)


# -- the default model -----------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_with_its_head_equals_generate(default_native):
    """SmolLM2 with the shipped head (a static-size EAGLE-2 tree: no calibration): streamed and whole
    answers equal plain decoding, and a follow-up turn keeps the history's KV."""
    target = default_native
    messages = [{"role": "user", "content": "Name three primary colours."}]
    ids = chat_prompt_ids(target.tokenizer, messages)
    ref = Engine(target).generate(ids, StopConfig(max_new_tokens=24))
    with LiveServer(make_service(target, method="eagle2@d3k2n3", max_tokens=24)) as url:
        client = openai.OpenAI(api_key="x", base_url=url + "/v1", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages)
        assert r.choices[0].message.content == ref.text and r.usage.model_extra["ddspec"]["tau"] > 1
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream) == ref.text
        follow = messages + [{"role": "assistant", "content": ref.text}, {"role": "user", "content": "And three more?"}]
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=follow)
        # kept: the first prompt and the answer (the head keeps one position less); prefilled: the new turn
        assert r.usage.prompt_tokens_details.cached_tokens == len(ids) + len(ref.token_ids) - 1

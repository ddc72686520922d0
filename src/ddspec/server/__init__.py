"""``ddspec serve``: an OpenAI-compatible HTTP server around one engine, and a chat page that
draws each step's draft tree.

protocol.py  request shapes and checks (OpenAI's errors)      worker.py  the engine's one thread
app.py       routes, SSE, auth, the page                       metrics.py Prometheus metrics
responses.py OpenAI response objects, usage, the page's trace
build.py     make_service (target -> running worker), LiveServer (uvicorn in a thread)
connections.py  uvicorn's h11 protocol with a headers deadline and a connection cap
cli.py       ``ddspec serve`` flags                             bench.py   ``ddspec bench-serve``
batch.py     continuous batching (BatchWorker: several requests' steps in one forward)
"""

# requests decoded together when --batch is not given, on a target that batches (the native one).
# Measured against one request at a time (2 CPU cores, AVX2-only AMD EPYC, default model, int8,
# docs/results/amd-epyc-25-1/serve-batch): one client 1.00-1.11x the tokens per second, 4 clients
# 1.5-1.7x with p50 latency 0.58-0.70x, 16 clients 1.4-1.8x with p99 latency 0.56-0.72x (their p50
# 0.99-1.39x: 16 requests arriving together finish together). A slot's KV cache grows only as far
# as its own requests need.
AUTO_BATCH = 16


def default_batch(target) -> int:
    """--batch when not given: AUTO_BATCH where the target runs several sequences' steps in one
    forward (``forward_many``: the native target), else 1."""
    return AUTO_BATCH if hasattr(target, "forward_many") else 1

"""``ddspec serve``: an OpenAI-compatible HTTP server around one engine, and a chat page that
draws each step's draft tree.

protocol.py  request shapes and checks (OpenAI's errors)      worker.py  the engine's one thread
app.py       routes, SSE, auth, the page                       metrics.py Prometheus metrics
responses.py OpenAI response objects, usage, the page's trace
build.py     make_service (target -> running worker), LiveServer (uvicorn in a thread)
connections.py  uvicorn's h11 protocol with a headers deadline and a connection cap
cli.py       ``ddspec serve`` flags                             bench.py   ``ddspec bench-serve``
"""

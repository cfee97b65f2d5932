"""`dsv4 serve`: an OpenAI-compatible server with continuous batching (docs/SERVING.md).

sampling   per-request sampling settings as data of the compiled step
(the step programs with the sampler inside live in dsv4_jax.runner)
text       incremental detokenization, stop strings, the streaming chat output parser
prefix     prefix caching: shared whole blocks + copied slot state
scheduler  continuous batching: host policy over the ModelRunner (no HTTP)
metrics    Prometheus metrics (needs the `serve` extra)
api        the FastAPI app (needs the `serve` extra)
run        build a server, serve it with uvicorn, or run it on a background thread
"""

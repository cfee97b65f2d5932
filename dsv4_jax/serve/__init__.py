"""`dsv4 serve`: an OpenAI-compatible server with continuous batching (docs/SERVING.md).

sampling   per-request sampling settings as data of one compiled sampler
text       incremental detokenization, stop strings, the streaming chat output parser
scheduler  continuous batching around Engine's step programs (no HTTP)
metrics    Prometheus metrics (needs the `serve` extra)
api        the FastAPI app (needs the `serve` extra)
"""

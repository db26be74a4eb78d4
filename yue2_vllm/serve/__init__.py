"""`yue2-vllm serve`: the HTTP API, durable job store and web page over the song scheduler.

Importing `yue2_vllm` does not import this package; it needs the `serve` extra (fastapi, uvicorn).
"""

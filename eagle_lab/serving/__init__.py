"""`python serve.py mode=server`: an OpenAI-compatible HTTP server over the decoding loops.

  app.py        FastAPI routes: /health, /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)
  protocol.py   request schemas and OpenAI-shaped response bodies
  errors.py     OpenAI-style error bodies ({"error": {message, type, param, code}})
  engine.py     request -> checked decoding job (prompt, sampling, limits); one decoder per request
  drafters.py   one drafter per active sequence, sharing the head's weights
  scheduler.py  the one thread that owns the model: continuous scheduling of rounds
  server.py     config checks, model loading, uvicorn, graceful SIGTERM

Rounds of the active sequences are interleaved (one sequence's round at a time), not yet
batched into one target forward: every request decodes exactly as it would alone.
"""

"""`python serve.py mode=server`: an OpenAI-compatible HTTP server over the decoding loops.

  app.py        FastAPI routes: /health, /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)
  protocol.py   request schemas and OpenAI-shaped response bodies
  errors.py     OpenAI-style error bodies ({"error": {message, type, param, code}})
  engine.py     request -> checked plan (prompt, sampling, limits) -> Decoding (a Sequence + its text)
  sequence.py   one request's decoding state, advanced round by round (prefill, draft, accept)
  batch.py      one padded target forward over several sequences' trees; per-row cache compaction
  batching.py   BatchScheduler: the batched round (continuous batching, tree per batch size)
  drafters.py   one drafter per active sequence, sharing the head's weights
  scheduler.py  the one thread that owns the model: admission, cancellation, retirement
  server.py     config checks, model loading, uvicorn, graceful SIGTERM

Every round scores the trees of all active sequences in one target forward (batch 1: the
very forward generate.py runs); each sequence verifies with its own generator and keeps its
own caches, so it decodes exactly as it would alone.
"""

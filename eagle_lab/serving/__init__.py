"""`python serve.py mode=server`: an OpenAI-compatible HTTP server over the decoding loops.

  app.py        FastAPI routes: /health, /v1/models, /v1/completions, /v1/chat/completions (SSE streaming)
  protocol.py   request schemas and OpenAI-shaped response bodies
  http_errors.py  OpenAI-style error bodies ({"error": {message, type, param, code}})
  engine.py     request -> checked plan (prompt, sampling, limits) -> Decoding (a Sequence + its text;
                eagle_lab/decoding/sequence.py, in a row of one static cache)
  batching.py   BatchScheduler: the batched round (continuous batching)
  batch_trees.py  the tree policy: (batch size, temperature) -> the row's own tree or plain decoding, timed
                in the batched round itself; the server's graphs built before it listens
  text_stream.py  token ids -> the text a client is sent (stop strings, partial UTF-8)
  scheduler.py  the one thread that owns the model: admission, cancellation, retirement
  server.py     config checks, model loading, uvicorn, graceful SIGTERM

Every round scores the trees of all active sequences in one forward of the static rows (batch 1
included); each sequence verifies with its own generator and keeps its own row, so it decodes
exactly as it would alone.
"""

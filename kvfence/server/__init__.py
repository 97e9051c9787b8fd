"""The OpenAI-compatible HTTP server (colocated mode): FastAPI app, async bridge to the engine, preflight."""

"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) over the engine loop thread.

Modules: `protocol` (request models, response bodies), `errors` (OpenAI's error object),
`async_engine` (the engine thread), `metrics` (Prometheus text), `app` (the routes).
"""

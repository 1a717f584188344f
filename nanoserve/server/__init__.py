"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) over the engine loop thread.

Modules, in the order a request meets them: `app` (builds the app and wires it), `routes`
(the endpoints), `planning` (a body to the engine's sequences, or a 4xx), `generation` (the
sequences in flight, unary answers), `streaming` (SSE). Beside them: `state` (limits and what
the app holds), `protocol` (request models, response bodies), `errors` (OpenAI's error object),
`engine_bridge` (the one interface the routes drive the engines through, and the commands a
bridge sends), its two bridges `async_engine` (the engine thread) and `replicas` (data-parallel
engine processes), `metrics` (Prometheus text), `tenants` (API keys, each a tenant, and what is
kept apart between them).
"""

"""The OpenAI-compatible HTTP server: `build_app` (FastAPI) over the engine bridges of its models.

Grouped by what each part speaks to:
- `openai/`: OpenAI's protocol (request models, response bodies), its routes (completions,
  chat, models, vLLM's tokenize/detokenize/version, health, metrics), server-sent events,
  embeddings, the Responses API and vLLM's runtime LoRA routes.
- `anthropic/`: Anthropic's Messages API (and its token count).
- `ollama/`: Ollama's API (`/api/chat`, `/api/generate`, `/api/embed`, the model listings).
- `parsers/`: what is read out of a model's text or a body's fields: tool calls, reasoning,
  structured-output fields.
- `bridges/`: between the event loop and the engine: `engine_bridge` (the one interface the
  routes drive an engine through, and the commands a bridge sends), one engine on its own thread
  (`async_engine`), or data-parallel replicas in processes of their own (`replicas`); and
  `models`, the served models by name, each its own bridge, loaded and unloaded on demand.
- Here, shared by every protocol, in the order a request meets them: `app` (builds the app and
  wires it), `planning` (a body to the engine's sequences, or a 4xx), `generation` (the
  sequences in flight, unary answers); beside them `state` (limits and what the app holds),
  `errors` (OpenAI's error object), `metrics` (Prometheus), `tenants` (API keys, each a tenant),
  `adapters` (the LoRA adapters a request may name), `connections` (uvicorn's protocol with a
  header deadline).
"""

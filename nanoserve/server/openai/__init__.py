"""OpenAI's HTTP protocol as vLLM serves it: request models, routes, streaming, embeddings, Responses."""

"""Ollama's HTTP API (`/api/*`): chat, generate and embed (`api`), the model listings (`models`)."""

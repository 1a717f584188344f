"""Between the event loop and the engine: one engine on a thread, or replicas in processes."""

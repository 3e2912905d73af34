"""`rvrun serve`: the OpenAI-compatible HTTP server over the engine."""

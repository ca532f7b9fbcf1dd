"""The OpenAI-compatible HTTP server: `create_app(ServerSettings(...))` builds the FastAPI app."""

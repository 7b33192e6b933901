"""ninfer-serve: the HTTP server (OpenAI, Anthropic and llama.cpp APIs) over one engine.

`app.create_app(settings, backend)` builds the FastAPI app; `server.Server` runs it; `engine_backend.
EngineBackend` is the real model behind it. See docs/api.md.
"""

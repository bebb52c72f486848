"""OpenAI-compatible HTTP server over LLMEngine (entry point: scripts/serve_hybrid.py; see docs/server.md)."""

"""OpenAI-compatible HTTP server over one `Engine` (needs the `serve` extra)."""

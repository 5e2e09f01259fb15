"""Workload drivers (no jax): `agentic` (the synthetic multi-turn sessions of `run`, driven on
engines in process), `chat_prompts` (real chat-templated text for them), `loadgen` (the same
sessions sent to an OpenAI server over HTTP, for `bench serve`)."""

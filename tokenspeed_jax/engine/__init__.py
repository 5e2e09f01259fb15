"""The host loop (no jax): `Engine` steps one scheduler + runner pair (synchronous or overlapped),
turns sampled ids into outputs and streams; `replicas` routes requests over data-parallel engines;
`step_clock` times steps and requests. The device side arrives as a `Runner` (runtime/)."""

from __future__ import annotations

from tokenspeed_jax.engine.engine import CheckedPrompt, Engine, Runner, StreamState
from tokenspeed_jax.engine.replicas import Replicas

__all__ = ["CheckedPrompt", "Engine", "Replicas", "Runner", "StreamState"]

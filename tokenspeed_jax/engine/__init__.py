"""The host loop (no jax): `Engine` steps one scheduler + runner pair (synchronous or overlapped),
turns sampled ids into outputs and streams; `replicas` routes requests over data-parallel engines;
`step_clock` times steps and requests. The device side arrives as a `Runner` (runtime/)."""

from __future__ import annotations

from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.replicas import Replicas
from tokenspeed_jax.engine.runner_protocol import Runner
from tokenspeed_jax.engine.tracks import CheckedPrompt, StreamState

__all__ = ["CheckedPrompt", "Engine", "Replicas", "Runner", "StreamState"]

"""The test helpers re-export the package's in-thread server (a real uvicorn on localhost)."""

from __future__ import annotations

from tokenspeed_jax.server.thread import ServerThread as LiveServer
from tokenspeed_jax.server.thread import free_port

__all__ = ["LiveServer", "free_port"]

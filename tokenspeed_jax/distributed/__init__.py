"""Multi-host serving: `launch` (config, `jax.distributed` initialization, follower liveness;
jax-free at import) and `runner` (the leader's step broadcast and the followers' replay; imports
jax, so it is not re-exported here)."""

from __future__ import annotations

from tokenspeed_jax.distributed.launch import DistributedConfig, initialize, leave, resolve

__all__ = ["DistributedConfig", "initialize", "leave", "resolve"]

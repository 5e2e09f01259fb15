"""Research hooks of `LLM` (issue 48): weights updated in place, sleep / wake, weight versions.

`update_weights(llm, weights, in_flight=..., weight_version=..., copy=...)`:
the update is checked and prepared first (`runtime.weight_update.WeightLoader.plan`: every
tensor's name, shape and dtype, every prepared leaf against the running one; a ValueError there
changes nothing: the old weights keep serving). Then, between steps, the requests in flight
either finish on the old weights (`in_flight="finish"`: stepped to completion here) or are
aborted (`"abort"`); the new leaves are swapped into every replica's runner, the prefix cache is
dropped (its K/V came from the old weights) and the weight version moves on (to
`weight_version`, else +1). Every `CompletionOutput` carries the version that generated it.

`sleep(llm, level)`: requests settled as above, prefix cache dropped, the KV pools, page-table
mirrors and penalty counts deleted (level 1); level 2 also drops the parameters.
`wake_up(llm, weights=None)`: the state is rebuilt with the shapes and shardings the step
executables were compiled for (no compile); after level 2 the parameters come back from
`weights` (anything `update_weights` takes) or, when None, are reloaded from where the current
ones came from (the model's checkpoint or built-in seed, or the directory of the last update
from disk); weights handed over from memory must be handed back. Memory is measured over
`jax.live_arrays()`.

Not on the multi-process runtime, and not for quantization="gguf" (its blocks come from the
file's own encoding).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import jax

from tokenspeed_jax.outputs import CompletionOutput

if TYPE_CHECKING:
    from tokenspeed_jax.llm import LLM
    from tokenspeed_jax.runtime.runner import ModelRunner
    from tokenspeed_jax.runtime.weight_update import WeightLoader

IN_FLIGHT = ("finish", "abort")


def live_bytes() -> int:
    """Bytes of every live jax array of this process (what sleeping gives back)."""
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _runners(llm: LLM) -> list[ModelRunner]:
    if llm._dist_runners:
        raise ValueError("weight updates and sleep are not supported on the multi-process runtime")
    from tokenspeed_jax.runtime.runner import ModelRunner

    runners = [e.runner for e in llm.engines]
    assert all(isinstance(r, ModelRunner) for r in runners)
    return runners  # type: ignore[return-value]


def loader(llm: LLM) -> WeightLoader:
    """The LLM's `WeightLoader` (built on first use)."""
    if llm.quantization == "gguf":
        raise ValueError("update_weights does not support quantization='gguf' (the file's own blocks)")
    if llm._weight_loader is None:
        from tokenspeed_jax.runtime.weight_update import WeightLoader

        llm._weight_loader = WeightLoader(llm.model_config, llm.family, llm.prepare_options)
    return llm._weight_loader


def settle(llm: LLM, in_flight: str) -> list[CompletionOutput]:
    """Requests in flight finished on the current weights ("finish") or aborted ("abort"); their
    outputs. Afterwards no engine holds a request or a step in flight."""
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
    outs: list[CompletionOutput] = []
    if in_flight == "finish":
        while llm.replicas.has_unfinished():
            outs += llm.replicas.step_busy()
    for e in llm.engines:
        outs += e.drain()
        outs += e.abort_all()
    return outs


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"weight_version must be an int, got {version!r}")


def _set_version(llm: LLM, version: int) -> None:
    _check_version(version)
    for e in llm.engines:
        e.weight_version = version


def update_weights(
    llm: LLM,
    weights: Any,
    *,
    in_flight: str = "finish",
    weight_version: int | None = None,
    copy: bool = False,
) -> dict[str, Any]:
    """See the module docstring. Returns {"weight_version", "seconds", "tensors" (raw tensors
    named), "replaced" (prepared leaves swapped, all replicas), "bytes" (of those), "outputs"
    (the requests settled by `in_flight`)}."""
    t0 = time.perf_counter()
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
    if weight_version is not None:
        _check_version(weight_version)
    runners = _runners(llm)
    plan = loader(llm).plan(weights, runners, copy=copy)
    if llm.sleep_level == 2 and any(x is None for leaves in plan.leaves for x in leaves):
        raise ValueError("the weights were dropped by sleep(level=2): an update must name every tensor")
    jax.block_until_ready([x for leaves in plan.leaves for x in leaves if x is not None])
    outs = settle(llm, in_flight)
    for runner, leaves in zip(runners, plan.leaves):
        runner.set_param_leaves(leaves)
    if llm.sleep_level == 2:
        llm.sleep_level = 1  # the weights are back: wake_up restores the pools only
    for e in llm.engines:
        e.scheduler.reset_prefix_cache()
    llm.weights_source = os.fspath(weights) if isinstance(weights, (str, os.PathLike)) else None
    _set_version(llm, llm.weight_version + 1 if weight_version is None else weight_version)
    return {
        "weight_version": llm.weight_version,
        "seconds": time.perf_counter() - t0,
        "tensors": plan.num_tensors,
        "replaced": plan.num_replaced,
        "bytes": plan.bytes,
        "outputs": outs,
    }


def sleep(llm: LLM, level: int = 1, *, in_flight: str = "finish") -> dict[str, Any]:
    """See the module docstring. Returns {"level", "freed_bytes" (live jax bytes given back),
    "kv_bytes" (of the device state deleted), "outputs"}."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}")
    runners = _runners(llm)
    outs = settle(llm, in_flight)
    before = live_bytes()
    kv = 0
    for e, runner in zip(llm.engines, runners):
        e.scheduler.reset_prefix_cache()
        e.sleeping = True
        kv += runner.release_state()
        if level == 2:
            runner.release_params()
    llm.sleep_level = max(llm.sleep_level, level)
    return {"level": level, "freed_bytes": before - live_bytes(), "kv_bytes": kv, "outputs": outs}


def _reload_source(llm: LLM) -> Any:
    """What wake_up reloads dropped weights from (ValueError when they came from memory)."""
    source = llm.weights_source
    if source is None:
        raise ValueError(
            f"the weights (version {llm.weight_version}) were handed over from memory and "
            "sleep(level=2) dropped them: pass them back, wake_up(weights=...)"
        )
    from tokenspeed_jax.models import registry

    if source in registry.BUILTIN_MODELS:
        return registry.load_builtin(source, seed=llm.args.seed, dtype=llm.dtype)[1]
    return registry.resolve_alias(source) if source in registry.MODEL_ALIASES else source


def wake_up(llm: LLM, weights: Any = None) -> dict[str, Any]:
    """See the module docstring. Returns {"seconds", "restored_bytes"}."""
    t0 = time.perf_counter()
    runners = _runners(llm)
    if llm.sleep_level == 0:
        return {"seconds": 0.0, "restored_bytes": 0}
    before = live_bytes()
    if llm.sleep_level == 2 or weights is not None:
        version, source = llm.weight_version, llm.weights_source
        given = weights if weights is not None else _reload_source(llm)
        plan = loader(llm).plan(given, runners)
        if llm.sleep_level == 2 and any(x is None for leaves in plan.leaves for x in leaves):
            raise ValueError("wake_up after sleep(level=2) needs every tensor of the model")
        for runner, leaves in zip(runners, plan.leaves):
            runner.set_param_leaves(leaves)
        if weights is None:
            llm.weights_source = source
        elif isinstance(weights, (str, os.PathLike)):
            llm.weights_source = os.fspath(weights)
        else:
            llm.weights_source = None
        _set_version(llm, version)
    for e, runner in zip(llm.engines, runners):
        runner.restore_state()
        e.sleeping = False
    jax.block_until_ready([r.state for r in runners])
    llm.sleep_level = 0
    return {"seconds": time.perf_counter() - t0, "restored_bytes": live_bytes() - before}


def family_of_model(model: str) -> str:
    """The Hugging Face family whose tensor names `update_weights` translates: a checkpoint
    directory's `config.json`; "" (Llama-style names) for the built-in models and aliases'
    own files alike when there is no config."""
    from tokenspeed_jax.models import registry

    path = registry.resolve_alias(model) if model in registry.MODEL_ALIASES else model
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return ""
    from tokenspeed_jax.hf.config import family_of

    with open(config) as f:
        return family_of(json.load(f))

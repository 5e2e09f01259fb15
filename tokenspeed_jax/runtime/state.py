"""Device state: per-group page-table mirrors and per-layer page pools, plus pool sizing.

`DeviceState` is a pytree updated functionally and donated to the jitted step:
  mirrors[g]  i32[max_live_requests, W_g]           the scheduler rows of group g (0 = hole)
  caches[l]   attention layer: {"k", "v": f[num_pages, B_g, Hkv, D]}; a quantized cache
              (`kv_cache_dtype` int8 / fp8_e4m3, `pallas_kernels.kv_quant`) holds int8 / fp8
              values there plus {"k_scale", "v_scale": f16[num_pages, B_g, Hkv]}
              conv layer:      {"conv": f[num_pages, B_g, hidden]} (per-token conv input)
              linear_attention layer: {"ssm": f32[num_pages, Hv, Dk, Dv], "conv_state":
                               f32[num_pages, K-1, C]} (one state snapshot per page)
              mamba layer:     {"ssm": f32[num_pages, H, Dh, N], "conv_state": f32[num_pages, K-1, C]}
              (scan_layers: caches[r] per run r of n layers, each pool f[n, num_pages, ...])
  last_tokens i32[max_live_requests]                the last token sampled for each slot: a
              step reads it for input tokens flagged `token_from_prev` (overlapped scheduling)
Page id p means the same index in every layer of every group (one shared BlockPool), or, with
a state pool of its own (`SchedulerConfig.state_pages`), the recurrent layers' pools have
`state_pages` rows indexed by the state pool's ids and the others `num_pages`. Page 0 is the
null page: all zeros, and the write path never targets it (holes drop their writes).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant, pool_bits
from scheduler.group_spec import LAYER_TYPE_GROUPS
from tokenspeed_jax.models import gated_delta, mamba2
from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.layer_scan import LayerRun, run_cache_shapes
from tokenspeed_jax.runtime.device_memory import device_memory

# CPU has no allocator statistics: pools get this budget (capped at a quarter of the free RAM).
# 1 GiB holds ~23k float32 tokens of SmolLM2-135M (256 MiB held 5.8k: 16 requests of 448 tokens
# need 7.2k, before the prefix cache keeps anything). `kv_cache_memory_bytes` sets it.
CPU_POOL_BUDGET_BYTES = 1024 * 1024 * 1024


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    mirrors: tuple[jax.Array, ...]
    caches: tuple[dict, ...]
    last_tokens: jax.Array


def layer_cache_shapes(
    config: ModelConfig,
    layer_groups: tuple[int, ...],
    page_sizes: tuple[int, ...],
    num_pages: int,
    kv_cache_dtype: str = "auto",
    state_pages: int | None = None,
) -> list[dict[str, tuple[int, ...]]]:
    """Shape of each layer's pool arrays (see module docstring); recurrent layers get
    `state_pages` rows (None: `num_pages`, the one shared pool)."""
    quantized = kv_quant.quantized_dtype(kv_cache_dtype) is not None
    snapshots = num_pages if state_pages is None else state_pages
    out: list[dict[str, tuple[int, ...]]] = []
    for layer, layer_type in enumerate(config.layer_types):
        b = page_sizes[layer_groups[layer]]
        if layer_type == "conv":
            out.append({"conv": (num_pages, b, config.hidden_size)})
        elif layer_type == "linear_attention":  # one snapshot per page, whatever its tokens
            out.append(gated_delta.state_pool_shapes(config, snapshots))
        elif layer_type == "mamba":
            out.append(mamba2.state_pool_shapes(config, snapshots))
        else:
            shape = (num_pages, b, config.num_key_value_heads, config.head_dim)
            out.append({"k": shape, "v": shape})
            if quantized:
                out[-1].update(k_scale=shape[:3], v_scale=shape[:3])
    return out


def pool_dtypes(
    config: ModelConfig, kv_cache_dtype: str = "auto", bits_pools: bool = False
) -> dict[str, jnp.dtype]:
    """The storage dtype of each pool name: the model's dtype for float pools, int8 / fp8
    values and f16 scales for a quantized K/V cache. bits_pools (the reference backend): 16- and
    8-bit floats stored as their unsigned bits (`pallas_kernels.pool_bits`)."""
    store = pool_bits.storage_dtype if bits_pools else jnp.dtype
    base = store(config.dtype)
    # recurrent state (models/gated_delta.py, mamba2.py) stays float32: it accumulates over the whole context
    f32 = jnp.dtype(jnp.float32)
    out = {"conv": base, "k": base, "v": base, "ssm": f32, "conv_state": f32}
    q = kv_quant.quantized_dtype(kv_cache_dtype)
    if q is not None:
        scale = store(kv_quant.SCALE_DTYPE)
        out.update(k=store(q), v=store(q), k_scale=scale, v_scale=scale)
    return out


def bytes_per_page(
    config: ModelConfig,
    layer_groups: tuple[int, ...],
    page_sizes: tuple[int, ...],
    kv_cache_dtype: str = "auto",
) -> int:
    """Device bytes one page id costs summed over every layer's pool (scales included)."""
    return sum(page_bytes_by_pool(config, layer_groups, page_sizes, kv_cache_dtype))


def page_bytes_by_pool(
    config: ModelConfig,
    layer_groups: tuple[int, ...],
    page_sizes: tuple[int, ...],
    kv_cache_dtype: str = "auto",
) -> tuple[int, int]:
    """(bytes of one page id over the layers that are not recurrent, bytes of one state
    snapshot over the recurrent layers): what a page id of the shared pool and of a state pool
    of its own cost. The second is 0 for a model without recurrent layers."""
    dtypes = pool_dtypes(config, kv_cache_dtype)
    shapes = layer_cache_shapes(config, layer_groups, page_sizes, 1, kv_cache_dtype)
    out = [0, 0]
    for layer_type, c in zip(config.layer_types, shapes):
        nbytes = sum(int(np.prod(s)) * dtypes[name].itemsize for name, s in c.items())
        out[LAYER_TYPE_GROUPS.get(layer_type) == "state"] += nbytes
    return out[0], out[1]


def split_pool_pages(
    budget_bytes: int,
    history_bytes: int,
    state_bytes: int,
    *,
    share: float,
    min_state_pages: int,
    max_pages: int = 1 << 20,
) -> tuple[int, int] | None:
    """(num_pages, state_pages), null pages included, of a budget split between the shared pool
    and a state pool of its own: the state pool gets `share` of the budget but at least
    `min_state_pages` ids, the shared pool the rest. None when that floor leaves the shared pool
    less than one page of its own (then the one shared pool serves the budget better)."""
    state_pages = min(max_pages, max(min_state_pages, int(share * budget_bytes) // state_bytes))
    num_pages = min(max_pages, (budget_bytes - state_pages * state_bytes) // history_bytes)
    if num_pages < 2:
        return None
    return int(num_pages), int(state_pages)


def fixed_state_bytes(config: ModelConfig, widths: tuple[int, ...], max_live_requests: int) -> int:
    """Device bytes of the per-slot state beside the pools, on each device (replicated under
    tensor parallelism): page-table mirrors i32[S, W_g], last tokens i32[S] and the penalty
    statistics (`sampling.PenaltyState`: i32 counts + bool seen, [S, vocab]); S = live slots."""
    return max_live_requests * (4 * sum(widths) + 4 + 5 * config.vocab_size)


def _free_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return CPU_POOL_BUDGET_BYTES * 4


def pages_from_memory(
    config: ModelConfig,
    layer_groups: tuple[int, ...],
    page_sizes: tuple[int, ...],
    *,
    device=None,
    gpu_memory_utilization: float = 0.9,
    temp_bytes: int = 0,
    max_pages: int = 1 << 20,
    shards: int = 1,
    reserved_bytes: int = 0,
    kv_cache_dtype: str = "auto",
    budget_bytes: int | None = None,
) -> int:
    """Number of page ids (null page included) that fit the device memory.

    Accelerators (`device_memory.device_memory`): the engine's share of the device,
    `gpu_memory_utilization` of its memory (at most the allocator's cap), less the bytes in use
    (so call it after the weights are on the device), the largest step's temporaries
    (`temp_bytes`: `ModelRunner.largest_step_temp_bytes`) and `reserved_bytes` (the fixed-size
    state allocated after this call: `fixed_state_bytes`; with a 128k vocabulary and 256 live
    slots the penalty statistics alone are ~164 MB). CPU (no memory stats): a fixed budget of
    `CPU_POOL_BUDGET_BYTES`, capped at a quarter of the free host RAM. At least 2 (null + one).
    shards: tensor-parallel degree; on accelerators each device holds 1/shards of every page
    (pools are sharded on kv heads / channels). CPU devices share one host RAM, so no scaling.
    budget_bytes: the pools' bytes per device, given (vLLM's `kv_cache_memory_bytes`): replaces
    both budgets above.
    """
    per_page = bytes_per_page(config, layer_groups, page_sizes, kv_cache_dtype)
    budget, shards = pool_budget(
        device, gpu_memory_utilization, temp_bytes, reserved_bytes, budget_bytes, shards
    )
    return int(max(2, min(max_pages, budget // -(-per_page // shards))))


def pool_budget(
    device,
    gpu_memory_utilization: float,
    temp_bytes: int,
    reserved_bytes: int,
    budget_bytes: int | None,
    shards: int,
) -> tuple[int, int]:
    """(the pools' bytes per device, the shards a page's bytes divide into on each device):
    the budget of `pages_from_memory` (its docstring says which)."""
    device = device or jax.devices()[0]
    memory = device_memory(device)
    if budget_bytes is not None:
        budget = budget_bytes
    elif memory is not None:
        budget = memory.engine_budget(gpu_memory_utilization) - temp_bytes - reserved_bytes
    else:
        budget = min(CPU_POOL_BUDGET_BYTES, _free_host_bytes() // 4)
    return budget, max(1, shards) if memory is not None else 1


def init_state(
    config: ModelConfig,
    layer_groups: tuple[int, ...],
    page_sizes: tuple[int, ...],
    widths: tuple[int, ...],
    *,
    num_pages: int,
    max_live_requests: int,
    runs: tuple[LayerRun, ...] | None = None,
    bits_pools: bool = False,
    kv_cache_dtype: str = "auto",
    state_pages: int | None = None,
) -> DeviceState:
    """All-zero mirrors (every column a hole) and all-zero pools (page 0 stays zero forever).

    runs: with scan_layers, one cache per run of layers, each pool stacked f[n, P, ...]
    (`models.layer_scan`); None = one cache per layer. bits_pools: the reference backend stores
    16- / 8-bit float pools as uint16 / uint8 bits (`pallas_kernels.pool_bits`).
    kv_cache_dtype: "auto" (the model's dtype), "int8" or "fp8_e4m3" (`pallas_kernels.kv_quant`;
    scale pools beside the K/V pools). state_pages: rows of the recurrent layers' pools when the
    state groups have a pool of their own (None: num_pages)."""
    for name, n in (("num_pages", num_pages), ("state_pages", state_pages)):
        if n is not None and n < 2:
            raise ValueError(f"{name} must be >= 2 (null page + one), got {n}")
    mirrors = tuple(jnp.zeros((max_live_requests, w), jnp.int32) for w in widths)
    shapes = layer_cache_shapes(config, layer_groups, page_sizes, num_pages, kv_cache_dtype, state_pages)
    if runs is not None:
        shapes = run_cache_shapes(shapes, runs)
    dtypes = pool_dtypes(config, kv_cache_dtype, bits_pools)
    caches = tuple({k: jnp.zeros(s, dtypes[k]) for k, s in c.items()} for c in shapes)
    last_tokens = jnp.zeros((max_live_requests,), jnp.int32)
    return DeviceState(mirrors=mirrors, caches=caches, last_tokens=last_tokens)

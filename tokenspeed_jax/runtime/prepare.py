"""Model preparation, once per `LLM` (issue 45): every in-place transform a model needs before
any `ModelRunner` sees it, done before the data-parallel replicas are built (they all share the
one model): KV-head replication and the conv re-layout for tensor parallelism, weight
quantization, the native matmul's tile-major layout."""

from __future__ import annotations

import contextlib
import dataclasses

from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.models.decoder import CausalLM
from tokenspeed_jax.models.layers import fuse_linears, tile_linears
from tokenspeed_jax.models.quant import check_quantization, quantize_model, use_native
from tokenspeed_jax.runtime import sharding

WEIGHT_LAYOUTS = ("auto", "checkpoint")


@dataclasses.dataclass(frozen=True)
class PreparedModel:
    """A model ready for `ModelRunner` (which never changes its weights' layout).

    config: the runtime config (num_key_value_heads widened to tensor_parallel_size when that
        exceeds the checkpoint's KV heads; the pools are sized from it).
    net: the model, transformed in place.
    tensor_parallel_size: the shards its layouts are made for (1: one device per replica).
    quantization: None or the `models.quant` mode its Linears hold.
    tiled: Linears laid out tile-major for the native CPU matmul (the unsharded one-device
        path only: a runner with a mesh refuses it); tiling fuses q/k/v and gate/up too.
    fused: q/k/v and gate/up fused into one Linear each, columns laid out for
        `tensor_parallel_size` shards (`models.layers.fuse_linears`).
    """

    config: ModelConfig
    net: CausalLM
    tensor_parallel_size: int = 1
    quantization: str | None = None
    tiled: bool = False
    fused: bool = False
    activation_dtype: str = "float32"

    def check_mesh(self, shards: int | None) -> None:
        """ValueError unless a runner over `shards` devices (None: no mesh) can run this model."""
        if (shards or 1) != self.tensor_parallel_size:
            raise ValueError(
                f"the model was prepared for tensor_parallel_size={self.tensor_parallel_size}; "
                f"the mesh has {shards or 1} devices"
            )
        if self.tiled and shards is not None:
            raise ValueError(
                "the model's Linears are tiled for one unsharded device (prepare(one_device="
                "True)); a runner with a mesh needs prepare(..., one_device=False)"
            )


def prepare(
    model_config: ModelConfig,
    net: CausalLM,
    *,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    host_staging: bool = False,
    one_device: bool = True,
    fuse: bool = False,
    activation_dtype: str | None = None,
    weight_layout: str = "auto",
) -> PreparedModel:
    """Check `tensor_parallel_size` against the model (ValueError naming the size it does not
    divide), then transform `net` in place: KV heads replicated up to the shard count (under
    `sharding.host_staging` when `host_staging`: lazy multi-process parameters stay on the
    host), conv in_proj re-laid for the channel shards, Linears quantized (after the re-layouts:
    scales follow the final columns) and, when the model runs unsharded on the default device
    (`one_device`: no mesh, i.e. no tensor or data parallelism) on a CPU with the native
    kernels built, tiled for them (the sharding rules place [in, out] kernels). `fuse` (the
    default on accelerators, `fuse_by_default`): q/k/v and gate/up fused into one product each,
    laid out for the tensor-parallel shards (not for lazy multi-process parameters, which are
    placed shard by shard as the checkpoint names them). `activation_dtype`: the residual
    stream's dtype; None: float32 where `wide_activations` says so, else the model dtype.
    `weight_layout="checkpoint"`: neither tiled nor fused, every Linear kept [in, out] as loaded
    (what a trainer holds), so `update_weights` can use a trainer's arrays as they are."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    tp = tensor_parallel_size
    check_quantization(quantization)
    with sharding.host_staging() if host_staging else contextlib.nullcontext():
        sharding.validate(model_config, tp)
        config = sharding.replicate_kv_heads(net, model_config, tp)
    if tp > 1:
        sharding.relayout_conv(net, tp)
        config = sharding.relayout_recurrent(net, config, tp)
    if quantization is not None:
        quantize_model(net, quantization)
    # use_native() also builds and registers the native custom calls, which must be known
    # before a stored executable that calls them loads (any tp)
    tiled = use_native() and one_device and tp == 1 and weight_layout == "auto"
    fuse = fuse and weight_layout == "auto"
    if tiled:
        tile_linears(net)
    fused = tiled or (fuse and not host_staging and fuse_linears(net, tp) > 0)
    if activation_dtype is None:
        wide = tiled and wide_activations(config, quantization)
        activation_dtype = "float32" if wide else config.dtype
    net.activation_dtype = activation_dtype
    return PreparedModel(
        config=config,
        net=net,
        tensor_parallel_size=tp,
        quantization=quantization,
        tiled=tiled,
        fused=fused,
        activation_dtype=activation_dtype,
    )


def wide_activations(config: ModelConfig, quantization: str | None) -> bool:
    """Whether a model tiled for the native CPU matmul keeps float32 activations over its bf16
    weights: XLA:CPU runs bf16 elementwise ops (norms, residual adds, SwiGLU) through converts,
    which cost SmolLM2 bf16 ~1.2x per step; the products still round their inputs to bf16 (the
    kernel's AMX / AVX512-BF16 path) and K/V pages stay bf16, so only the elementwise ops and
    the residual stream gain precision. Attention-only dense models, unquantized weights (the
    layer kinds whose state pools, experts and quantized paths were checked with it)."""
    attention_only = all(t in ("full_attention", "sliding_attention") for t in config.layer_types)
    return (
        config.dtype == "bfloat16"
        and attention_only
        and config.num_local_experts == 0
        and quantization is None
    )


def fuse_by_default(platform: str) -> bool:
    """Fuse q/k/v and gate/up off CPU: an accelerator runs 3 GEMMs a layer instead of 5 (on
    CPU the native kernel's tiling fuses them when it takes the model)."""
    return platform != "cpu"

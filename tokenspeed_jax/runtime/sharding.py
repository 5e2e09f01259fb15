"""Tensor-parallel and data-parallel placement: meshes, parameter partition rules, state sharding.

Layout (Megatron-style, expressed as GSPMD `NamedSharding`s on a 1-D mesh with axis "tp"; XLA
inserts the collectives, one all-reduce after each row-parallel projection):

* attention: q/k/v projections column-sharded by head (kernel `[H, heads*D]` split on its output
  axis, so every shard holds whole heads: q heads `[s*Hq/tp, (s+1)*Hq/tp)` and their GQA kv heads
  `[s*Hkv/tp, ...)`), o_proj row-sharded; attention sinks sharded with the q heads; q/k norms
  (over head_dim) replicated. K/V pools `[P, B, Hkv, D]` sharded on the kv-head axis.
* dense MLP: gate/up column-sharded, down row-sharded (on the intermediate axis).
* fused q/k/v and gate/up (`models.layers.fuse_linears`, on accelerators): the fused kernel's
  columns are interleaved per shard, `[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`, so column-sharding it
  gives each shard its own heads of all three and `split_fused` cuts them locally.
* MoE: sharded on the **intermediate** axis of every expert (gate/up `[E, H, I]` on I, down
  `[E, I, H]` on I), router replicated. Every device sees every token and every expert, so the
  routing and the ragged grouping stay local and the only collective is the same all-reduce as a
  dense MLP; expert sharding would need an all-to-all of tokens instead.
* LFM2 conv: channel-sharded. in_proj's `[H, 3H]` output is (B, C, x) gates; its columns are
  permuted to `[B_0 C_0 x_0 | B_1 C_1 x_1 | ...]` (shard s's channels of the three gates side by
  side) and the module's `gate_shards` tells `ShortConv._gates` the layout, so the gates, the
  depthwise conv, the conv pool `[P, B, hidden]` (channel axis) and the conv weights are all
  local; out_proj is row-sharded.
* Gated DeltaNet / Mamba2: heads sharded, in_proj re-laid per shard so each shard's q / k / v
  (or x / B / C) channels are local, recurrent state pools on heads, conv tails on channels,
  out_proj row-sharded (`runtime/recurrent_shards.py`).
* embeddings / lm_head: sharded on the vocabulary when `vocab % tp == 0` (else replicated). The
  logits of the sampled rows are gathered (replicated) before sampling; prompt logprobs reduce
  the vocab-sharded logits in place.
* everything else (norms, RoPE tables, page-table mirrors, every StepOps array): replicated.

Pallas kernels (and the jnp reference attention) run under `shard_map` over the head / channel
axis: each shard runs the unmodified kernel on its local heads or channels (attention and the
depthwise conv never mix heads or channels).

KV-head replication (tp > num_key_value_heads, tp a multiple of it; as vLLM): every shard needs
the one KV head its query heads read, so `replicate_kv_heads` widens k/v_proj to tp heads (KV
head j repeated tp/Hkv times, consecutively) and the runtime config says `num_key_value_heads =
tp`: shard s holds KV head s // (tp/Hkv), exactly the head its query heads
[s*Hq/tp, (s+1)*Hq/tp) map to under GQA, and each pool shard holds one KV head. Mathematically
the forward is unchanged (duplicated heads, same GQA mapping).

Data parallel: `replica_meshes(tp, dp)` gives replica r the devices `[r*tp, (r+1)*tp)`. In a
multi-process run (`jax.process_count() > 1`) every replica spans every process instead (the
leader schedules all replicas, so each replica's step must run on every process): replica r
takes local devices `[r*tp/N, (r+1)*tp/N)` of each of the N processes, process-major on the
"tp" axis; `global_device_grid` is that `[dp, tp]` device grid (the global mesh).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tokenspeed_jax.models.config import ModelConfig
from tokenspeed_jax.runtime import recurrent_shards
from tokenspeed_jax.runtime.param_sources import ParamSource, place_sources

AXIS = "tp"

# (regex over the "/"-joined parameter path, spec); the first match of the parameter's rank wins
# (per-channel and block scales share a name), no match = replicated.
_COLUMN_PARALLEL = (
    r"(self_attn/(q|k|v|qkv)_proj|mlp/(gate|up|gate_up)_proj|conv/in_proj|linear_attn/in_proj_(qkv|z|b|a)"
    r"|mamba/in_proj)"
)
_ROW_PARALLEL = r"(self_attn/o_proj|mlp/down_proj|(conv|linear_attn|mamba)/out_proj)"
_RULES: tuple[tuple[str, P], ...] = (
    (r"self_attn/(q|k|v|qkv)_proj/kernel$", P(None, AXIS)),
    (r"self_attn/(q|k|v|qkv)_proj/bias$", P(AXIS)),
    (r"self_attn/o_proj/kernel$", P(AXIS, None)),
    (r"self_attn/sinks$", P(AXIS)),
    (r"mlp/(gate|up|gate_up)_proj/kernel$", P(None, AXIS)),
    (r"mlp/(gate|up|gate_up)_proj/bias$", P(AXIS)),
    (r"mlp/down_proj/kernel$", P(AXIS, None)),
    (r"mlp/experts/(gate|up)_proj$", P(None, None, AXIS)),
    (r"mlp/experts/(gate|up)_bias$", P(None, AXIS)),
    (r"mlp/experts/down_proj$", P(None, AXIS, None)),
    (r"conv/in_proj/kernel$", P(None, AXIS)),
    (r"conv/in_proj/bias$", P(AXIS)),
    (r"conv/conv_weight$", P(None, AXIS)),
    (r"conv/conv_bias$", P(AXIS)),
    (r"conv/out_proj/kernel$", P(AXIS, None)),
    # recurrent mixers, heads sharded (runtime/recurrent_shards.py re-lays in_proj per shard)
    (r"(linear_attn/in_proj_(qkv|z|b|a)|mamba/in_proj)/kernel$", P(None, AXIS)),
    (r"mamba/in_proj/bias$", P(AXIS)),
    (r"(linear_attn|mamba)/conv_weight$", P(None, AXIS)),
    (r"(linear_attn/(dt_bias|A_log)|mamba/(conv_bias|dt_bias|A_log|D|norm/weight))$", P(AXIS)),
    (r"(linear_attn|mamba)/out_proj/kernel$", P(AXIS, None)),
    # int8 weights (models/quant.py): a column-parallel kernel's scales split with its columns;
    # a row-parallel kernel's (o_proj, down_proj, out_proj) stay whole on every shard
    (rf"{_COLUMN_PARALLEL}/kernel_scale$", P(AXIS)),
    # block scales / mins f32[in/32, out] (models/block_quant.py) split like their kernel
    (rf"{_COLUMN_PARALLEL}/kernel_(scale|min)$", P(None, AXIS)),
    (rf"{_ROW_PARALLEL}/kernel_(scale|min)$", P(AXIS, None)),
    (rf"{_ROW_PARALLEL}/kernel_scale$", P(None)),  # per channel
)
# scan_layers params (models/layer_scan.py): the shell's paths, and a run's stacked layers
_SCANNED = re.compile(r"^(shell/|runs/\d+/)")
_VOCAB_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed_tokens$", P(AXIS, None)),
    (r"^lm_head/kernel$", P(None, AXIS)),
    (r"^(lm_head/kernel_scale|embed_scale_q)$", P(AXIS)),
)


def validate(config: ModelConfig, tp: int) -> None:
    """ValueError naming the size that `tp` does not divide (heads, kv heads, intermediate,
    conv channels). tp a multiple of num_key_value_heads is fine (KV-head replication)."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    hkv = config.num_key_value_heads
    if hkv % tp and tp % hkv:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide num_key_value_heads={hkv} "
            f"(nor is it a multiple of it, which would replicate KV heads)"
        )
    checks = [
        ("num_attention_heads", config.num_attention_heads),
        ("intermediate_size", config.intermediate_size),
    ]
    if "conv" in config.layer_types:
        checks.append(("hidden_size (conv channels)", config.hidden_size))
    for name, size in checks:
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={size}")
    recurrent_shards.validate(config, tp)


def replica_meshes(tp: int, dp: int, devices: Sequence | None = None) -> list[Mesh]:
    """One 1-D "tp" mesh per data-parallel replica; replica r owns devices [r*tp, (r+1)*tp)
    (multi-process: row r of `global_device_grid`)."""
    if tp < 1 or dp < 1:
        raise ValueError("tensor_parallel_size and data_parallel_size must be >= 1")
    if devices is None and jax.process_count() > 1:
        return [Mesh(row, (AXIS,)) for row in global_device_grid(tp, dp)]
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ValueError(
            f"tensor_parallel_size * data_parallel_size = {tp} * {dp} = {tp * dp} "
            f"exceeds the {len(devices)} available device(s)"
        )
    return [Mesh(np.array(devices[r * tp : (r + 1) * tp]), (AXIS,)) for r in range(dp)]


def global_device_grid(tp: int, dp: int) -> np.ndarray:
    """Devices [dp, tp] of a multi-process run: each replica (row) takes tp/N local devices of
    every one of the N processes (see the module docstring)."""
    nproc = jax.process_count()
    local = [
        sorted((d for d in jax.devices() if d.process_index == k), key=lambda d: d.id) for k in range(nproc)
    ]
    if tp % nproc:
        raise ValueError(
            f"tensor_parallel_size={tp} must be a multiple of the {nproc} processes: "
            f"every replica spans every process (the leader schedules them all)"
        )
    per = tp // nproc
    have = min(len(x) for x in local)
    if per * dp > have:
        raise ValueError(
            f"tensor_parallel_size * data_parallel_size = {tp} * {dp} = {tp * dp} "
            f"exceeds the {nproc * have} available device(s) of {nproc} processes"
        )
    return np.array([[d for k in range(nproc) for d in local[k][r * per : (r + 1) * per]] for r in range(dp)])


def replicate_kv_heads(model, config: ModelConfig, tp: int) -> ModelConfig:
    """KV-head replication for tp > num_key_value_heads (in place, idempotent): widens every
    attention layer's k/v projections from Hkv to tp heads (head j repeated tp/Hkv times) and
    returns the runtime config (num_key_value_heads = tp; pools are sized from it). A no-op
    returning `config` when tp <= Hkv."""
    hkv = config.num_key_value_heads
    if tp <= hkv:
        return config
    validate(config, tp)
    rep, d = tp // hkv, config.head_dim
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or attn.num_kv_heads == tp:
            continue
        # column c of the widened projection = column (c // d // rep) * d + c % d of the original
        cols = np.arange(tp * d)
        cols = (cols // d // rep) * d + cols % d
        for proj in (attn.k_proj, attn.v_proj):
            proj.kernel.set_value(_take(proj.kernel.get_value(), cols, axis=1))
            if proj.bias is not None:
                proj.bias.set_value(_take(proj.bias.get_value(), cols, axis=0))
        attn.num_kv_heads = tp
    return dataclasses.replace(config, num_key_value_heads=tp)


def _take(x, index: np.ndarray, axis: int):
    """x.take(index, axis) for arrays, or the lazy equivalent for a `ParamSource` (nothing read)."""
    if isinstance(x, ParamSource):
        return x.take(axis, index)
    return jnp.take(x, jnp.asarray(index), axis=axis)


def host_staging():
    """Context that makes new arrays land on this process's first CPU device (host memory), so a
    model built or loaded inside it never sits whole on an accelerator; a no-op context when no
    CPU backend is available."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:
        return contextlib.nullcontext()


def place(tree, shardings):
    """`jax.device_put(tree, shardings)`, except that leaves whose sharding spans several
    processes are assembled per shard with `jax.make_array_from_callback`: each process copies
    only the shards its devices hold, and no cross-process equality check (which would broadcast
    and compare every weight) runs. `param_sources.ParamSource` leaves (lazy loads) are read /
    generated per shard (`param_sources.place_sources`)."""

    def one(x, sh):
        if isinstance(x, ParamSource):
            return x  # below, all together
        if sh.is_fully_addressable:
            return jax.device_put(x, sh)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])

    tree = jax.tree.map(one, tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    if not any(isinstance(x, ParamSource) for x in leaves):
        return tree
    # lazy parameters (multi-process loads): each process reads / generates only its shards
    return jax.tree.unflatten(treedef, place_sources(leaves, jax.tree.leaves(shardings)))


def _path_str(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name == "value":  # nnx.Variable's leaf
            continue
        parts.append(str(name))
    return "/".join(parts)


def _gate_perm(h: int, n: int) -> np.ndarray:
    """Column order of in_proj with shard-interleaved gates: for shard s, (B, C, x) channels
    [s*h/n, (s+1)*h/n) side by side. n = 1 is the identity."""
    c = h // n
    return np.concatenate([g * h + s * c + np.arange(c) for s in range(n) for g in range(3)])


def relayout_recurrent(model, config: ModelConfig, tp: int) -> ModelConfig:
    """Re-lays the Gated DeltaNet / Mamba2 layers for `tp` head shards (in place;
    `runtime.recurrent_shards`) and returns the runtime config (Mamba2's B / C groups
    replicated up to tp)."""
    recurrent_shards.relayout_recurrent(model, tp, _take)
    return recurrent_shards.runtime_config(config, tp)


def relayout_conv(model, tp: int) -> None:
    """Re-lays in_proj of every conv block for `tp` channel shards (in place, idempotent).

    The forward is unchanged mathematically: `ShortConv._gates` reads the layout back through the
    module's `gate_shards`."""
    for layer in model.layers:
        conv = getattr(layer, "conv", None)
        if conv is None:
            continue
        old = getattr(conv, "gate_shards", 1)
        if old == tp:
            continue
        h = conv.conv_weight.get_value().shape[-1]
        # old layout -> canonical [B | C | x] -> new layout
        order = np.argsort(_gate_perm(h, old))[_gate_perm(h, tp)]
        conv.in_proj.kernel.set_value(_take(conv.in_proj.kernel.get_value(), order, axis=1))
        if conv.in_proj.bias is not None:
            conv.in_proj.bias.set_value(_take(conv.in_proj.bias.get_value(), order, axis=0))
        conv.gate_shards = tp


class TensorParallel:
    """Shardings of one replica: params by path, device state, and the kernel wrappers."""

    def __init__(self, mesh: Mesh, config: ModelConfig):
        self.mesh = mesh
        self.tp = int(mesh.shape[AXIS])
        validate(config, self.tp)
        self.shard_vocab = config.vocab_size % self.tp == 0
        self.replicated = NamedSharding(mesh, P())

    # ------------------------------------------------------------------ params / state
    def spec_for(self, path: str, ndim: int) -> P:
        rules = _RULES + (_VOCAB_RULES if self.shard_vocab else ())
        matched = [spec for pattern, spec in rules if re.search(pattern, path)]
        for spec in matched:
            if len(spec) == ndim:
                return spec
        if matched:
            raise ValueError(f"parameter {path}: rank {ndim} does not match spec {matched[0]}")
        return P()

    def param_shardings(self, params):
        """A pytree like `params` (an nnx.State, or scan_layers' {"shell", "runs"}: a run's
        stacked layers keep their layer's spec behind an unsharded leading axis) of
        NamedShardings."""

        def one(p, x):
            path, ndim, lead = _path_str(p), np.ndim(x), ()
            scanned = _SCANNED.match(path)
            if scanned:
                path = path[scanned.end() :]
                if scanned.group(0).startswith("runs/"):
                    ndim, lead = ndim - 1, (None,)
            return NamedSharding(self.mesh, P(*lead, *self.spec_for(path, ndim)))

        return jax.tree_util.tree_map_with_path(one, params)

    def state_shardings(self, state):
        """DeviceState shardings: mirrors replicated, K/V pools and their scales (a quantized
        cache) on kv heads, conv pools and recurrent conv tails on channels, recurrent states on
        heads."""

        def one(path, x):
            name = _path_str(path).rsplit("/", 1)[-1]
            lead = (None,) * (np.ndim(x) - (4 if name in ("k", "v", "ssm") else 3))  # scan_layers: 1
            if name in ("k", "v") and len(lead) in (0, 1):
                return NamedSharding(self.mesh, P(*lead, None, None, AXIS, None))
            if name == "ssm" and len(lead) in (0, 1):  # recurrent state f32[P, heads, ...]
                return NamedSharding(self.mesh, P(*lead, None, AXIS, None, None))
            # last axis: channels (conv, recurrent conv tails) / kv heads (scales)
            if name in ("conv", "conv_state", "k_scale", "v_scale") and len(lead) in (0, 1):
                return NamedSharding(self.mesh, P(*lead, None, None, AXIS))
            return self.replicated

        return jax.tree_util.tree_map_with_path(one, state)

    def gather_logits(self, logits: jax.Array) -> jax.Array:
        """Inside the jitted step: vocab-sharded logits f[R, V] -> replicated. Pinning the
        vocab-sharded layout first makes XLA gather the [R, V] logits, not the [H, V] lm_head
        (which it picks when only the replicated result is constrained)."""
        wsc = jax.lax.with_sharding_constraint
        if self.shard_vocab:
            logits = wsc(logits, NamedSharding(self.mesh, P(None, AXIS)))
        return wsc(logits, self.replicated)

    # ------------------------------------------------------------------ kernels
    def wrap_attention(self, fn: Callable) -> Callable:
        """`fn` (SPEC paged_attention signature) run per shard on its local q / kv heads."""
        heads, pool, rep = P(None, AXIS, None), P(None, None, AXIS, None), P()
        mesh = self.mesh

        scales = P(None, None, AXIS)  # a quantized cache's f16[P, B, Hkv] scale pools

        @functools.wraps(fn)
        def wrapped(
            q,
            k_pages,
            v_pages,
            page_table,
            kv_lens,
            cu_q_lens,
            num_seqs,
            *,
            sinks=None,
            k_scales=None,
            v_scales=None,
            **kw,
        ):
            args = [q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs]
            specs = [heads, pool, pool, rep, rep, rep, rep]
            optional = [
                name
                for name, x in (("sinks", sinks), ("k_scales", k_scales), ("v_scales", v_scales))
                if x is not None
            ]
            for name in optional:
                args.append({"sinks": sinks, "k_scales": k_scales, "v_scales": v_scales}[name])
                specs.append(P(AXIS) if name == "sinks" else scales)

            def local(*a):
                return fn(*a[:7], **dict(zip(optional, a[7:], strict=True)), **kw)

            # check_vma off: pallas_call has no varying-manual-axes rule
            return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(
                *args
            )

        return wrapped

    def wrap_conv(self, fn: Callable | None) -> Callable | None:
        """`fn` (pallas short_conv signature) run per shard on its local channels; None stays
        None (the model's jnp taps run under GSPMD: gathers over the sharded channel axis are
        local)."""
        if fn is None:
            return None
        chan, pool, rep = P(None, AXIS), P(None, None, AXIS), P()
        mesh = self.mesh

        @functools.wraps(fn)
        def wrapped(x, conv_pages, page_table, kv_lens, cu_q_lens, num_seqs, weight, bias=None):
            args = [x, conv_pages, page_table, kv_lens, cu_q_lens, num_seqs, weight]
            specs = [chan, pool, rep, rep, rep, rep, chan]
            if bias is not None:
                args.append(bias)
                specs.append(P(AXIS))

            def local(*a):
                return fn(*a[:7], a[7] if len(a) > 7 else None)

            return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=chan, check_vma=False)(
                *args
            )

        return wrapped

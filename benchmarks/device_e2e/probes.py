"""Step 4: plain JAX on the same device, the comparators of step 2's decode.

- read probe: a jitted sum over a bf16 array of WEIGHT_BYTES (reads only): GB/s;
- copy probe: a jitted `x * 2` over a quarter of that (read + write, both counted): GB/s;
- dense-KV decode: one decode step of the same model shape written in plain JAX (weights
  stacked per layer and `lax.scan`ned, a dense [rows, context] KV cache per layer, GQA attention
  by einsum), random bf16 weights drawn on the device: ms/step at each ROWS count, at
  PROMPT_LEN context. The best plain-JAX comparator for our paged decode.
"""

from __future__ import annotations

import time

import common  # noqa: F401  (sys.path)
from common import MODEL, PROMPT_LEN, ROWS, param_count, result


def timed(f, *args, reps: int = 5) -> float:
    import jax

    jax.block_until_ready(f(*args))  # compile + warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def bandwidth() -> None:
    import jax
    import jax.numpy as jnp

    n = param_count(MODEL)
    x = jnp.ones((n,), jnp.bfloat16)
    read_s = timed(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x)
    y = x[: n // 4]
    copy_s = timed(jax.jit(lambda a: a * 2), y)
    result(
        "4_bandwidth", read_gb_s=2 * n / read_s / 1e9, copy_gb_s=2 * 2 * (n // 4) / copy_s / 1e9, bytes=2 * n
    )
    del x, y


def dense_decode() -> None:
    import jax
    import jax.numpy as jnp

    c = MODEL
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    key = jax.random.PRNGKey(0)

    def rnd(k, shape, std=0.02):
        return (jax.random.normal(jax.random.fold_in(key, k), shape, jnp.float32) * std).astype(jnp.bfloat16)

    make = jax.jit(lambda: dict(
        wqkv=rnd(1, (L, h, (hq + 2 * hkv) * d)), wo=rnd(2, (L, hq * d, h)),
        wgu=rnd(3, (L, h, 2 * i)), wd=rnd(4, (L, i, h)), emb=rnd(5, (v, h)), head=rnd(6, (h, v)),
    ))  # fmt: skip
    w = make()

    def rms(x):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)

    def step(w, k_cache, v_cache, tokens, pos):
        b = tokens.shape[0]
        x = w["emb"][tokens]

        def layer(x, lw):
            wqkv, wo, wgu, wd, kc, vc = lw
            qkv = rms(x) @ wqkv
            q = qkv[:, : hq * d].reshape(b, hkv, hq // hkv, d)
            k = qkv[:, hq * d : (hq + hkv) * d].reshape(b, hkv, d)
            vv = qkv[:, (hq + hkv) * d :].reshape(b, hkv, d)
            kc = jax.lax.dynamic_update_slice_in_dim(kc, k[:, None], pos, axis=1)
            vc = jax.lax.dynamic_update_slice_in_dim(vc, vv[:, None], pos, axis=1)
            s = jnp.einsum("bhgd,bthd->bhgt", q, kc, preferred_element_type=jnp.float32) / d**0.5
            s = jnp.where(jnp.arange(kc.shape[1]) <= pos, s, -jnp.inf)
            p = jax.nn.softmax(s, -1).astype(jnp.bfloat16)
            o = jnp.einsum("bhgt,bthd->bhgd", p, vc).reshape(b, hq * d)
            x = x + o @ wo
            g, u = jnp.split(rms(x) @ wgu, 2, -1)
            return x + (jax.nn.silu(g) * u) @ wd, (kc, vc)

        x, (k_cache, v_cache) = jax.lax.scan(
            layer, x, (w["wqkv"], w["wo"], w["wgu"], w["wd"], k_cache, v_cache)
        )
        logits = (rms(x) @ w["head"]).astype(jnp.float32)
        return jnp.argmax(logits, -1), k_cache, v_cache

    f = jax.jit(step, donate_argnums=(1, 2))
    weights = sum(x.nbytes for x in jax.tree.leaves(w))
    for rows in ROWS:
        ctx = PROMPT_LEN + 64
        kc = jnp.zeros((L, rows, ctx, hkv, d), jnp.bfloat16)
        vc = jnp.zeros_like(kc)
        tokens = jnp.zeros((rows,), jnp.int32)
        pos = jnp.int32(PROMPT_LEN)
        tok, kc, vc = f(w, kc, vc, tokens, pos)  # compile
        jax.block_until_ready(tok)
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            tok, kc, vc = f(w, kc, vc, tok, pos)
            jax.block_until_ready(tok)
            ts.append(time.perf_counter() - t)
        ms = 1e3 * sorted(ts)[len(ts) // 2]
        kv_read = 2 * kc.nbytes * PROMPT_LEN // ctx
        result(
            "4_dense_decode",
            rows=rows,
            ms_per_step=ms,
            tok_s=rows / ms * 1e3,
            read_bytes_per_step=weights + kv_read,
        )
        del kc, vc


if __name__ == "__main__":
    bandwidth()
    dense_decode()

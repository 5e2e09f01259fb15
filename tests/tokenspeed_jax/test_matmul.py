"""`models.layers.matmul`: float32 accumulation, rounded to the input dtype, and on XLA:CPU a
bf16 dot that never converts its weight to float32 (what a plain bf16 `x @ w` compiles to)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.native_kernels import need_native
from tokenspeed_jax.models.layers import matmul


@pytest.mark.parametrize("lead", [(5,), (1,), (), (1, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_equals_float32_dot_rounded(dtype, transposed, lead):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*lead, 64)), dtype)
    w = jnp.asarray(rng.standard_normal((64, 48)), dtype)
    got = matmul(x, w.T if transposed else w, w_transposed=transposed)
    want = (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(dtype)
    assert got.dtype == dtype and got.shape == (*lead, 48)
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(want, np.float32),
        rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
        atol=1e-5,
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's bf16 dot")
@pytest.mark.parametrize("rows", [16, 1])  # one row: XLA:CPU's vector-matrix path upcasts w
def test_bf16_weights_are_not_converted_per_call(rows):
    x = jnp.ones((rows, 576), jnp.bfloat16)
    w = jnp.ones((576, 1536), jnp.bfloat16)

    def f32_weights(fn) -> int:
        return jax.jit(fn).lower(x, w).compile().as_text().count("f32[576,1536]")

    assert f32_weights(lambda a, b: matmul(a, b)) == 0
    assert f32_weights(lambda a, b: matmul(a, b.T.T)) == 0
    assert f32_weights(lambda a, b: a @ b) > 0  # the plain bf16 dot: the reason for matmul


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's native kernel")
def test_bf16_weights_take_the_native_kernel():
    """bf16 [K, N] weights run as one custom call of the native block kernel (faster than XLA's
    bf16 dot on CPU); a transposed (tied) table and float32 weights stay on XLA's dot."""
    need_native("block_matmul")  # fails in CI ($TOKENSPEED_JAX_REQUIRE_NATIVE) if unbuilt

    def calls(x, w, **kw) -> int:
        hlo = jax.jit(lambda a, b: matmul(a, b, **kw)).lower(x, w).compile().as_text()
        return hlo.count('custom_call_target="tokenspeed_block_matmul"')

    x = jnp.ones((4, 64), jnp.bfloat16)
    assert calls(x, jnp.ones((64, 48), jnp.bfloat16)) == 1
    assert calls(x, jnp.ones((48, 64), jnp.bfloat16), w_transposed=True) == 0
    assert calls(x.astype(jnp.float32), jnp.ones((64, 48), jnp.float32)) == 0

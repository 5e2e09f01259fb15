"""RoPE frequency tables, including the scaling variants the supported families ship with.

`rope_parameters(...) -> (inv_freq f32[head_dim // 2], attention_factor)`.
`attention_factor` multiplies cos and sin (YaRN's "mscale"), i.e. both q and k; the decoder folds
its square into the softmax scale, which is the same math without touching every rotated vector.

Variants (Hugging Face `rope_scaling` / `rope_parameters["rope_type"]`):
* "default": inv_freq_i = theta^(-2i/d).
* "linear": positions divided by `factor` (= inv_freq / factor).
* "llama3": Llama 3.1 band-wise interpolation (low frequencies / factor, high ones untouched,
  smooth blend in between) over `original_max_position_embeddings`.
* "yarn": NTK-by-parts interpolation with a linear ramp between the `beta_fast`/`beta_slow`
  correction dims, plus the attention factor 0.1 * ln(factor) + 1 (GPT-OSS, Qwen long context).
Tables are computed in float64 and rounded once to float32, so they sit within an ulp of the
float32 tables transformers computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(rope_scaling: Mapping[str, Any] | None) -> str:
    """The variant name of a scaling dict (`rope_type`, legacy `type`); None/{} -> "default"."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _base_inv_freq(dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3(inv_freq: np.ndarray, p: Mapping[str, Any]) -> np.ndarray:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than old_ctx/low are interpolated, shorter than old_ctx/high kept,
    # and the band in between blends the two linearly in old_ctx / wavelen.
    scaled = np.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return np.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, p: Mapping[str, Any], max_pos: int | None) -> tuple[np.ndarray, float]:
    orig = p.get("original_max_position_embeddings") or max_pos
    if orig is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = p.get("factor")
    if factor is None:
        if max_pos is None:
            raise ValueError("yarn rope scaling needs a factor or max_position_embeddings")
        factor = max_pos / orig
    factor = float(factor)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = p.get("beta_fast") or 32.0
    beta_slow = p.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        # The dim index whose wavelength makes `rotations` turns over the original context.
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = _base_inv_freq(dim, theta)
    interpolation = extrapolation / factor
    keep = 1.0 - ramp  # 1 = keep the original (high-frequency) rotation
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def rope_parameters(
    head_dim: int,
    rope_theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[np.ndarray, float]:
    """(inv_freq f32[head_dim // 2], attention_factor) of a RoPE variant; see module docstring."""
    kind = rope_type_of(rope_scaling)
    p = dict(rope_scaling or {})
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported")
    inv = _base_inv_freq(head_dim, rope_theta)
    factor = 1.0
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, p)
    elif kind == "yarn":
        inv, factor = _yarn(head_dim, rope_theta, p, max_position_embeddings)
    else:
        raise NotImplementedError(
            f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return inv.astype(np.float32), factor

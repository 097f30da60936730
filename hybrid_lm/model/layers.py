"""Parameter-holding building blocks: embedding, RMSNorm, SwiGLU, RoPE.

Every parameter carries ``logical_axes`` metadata; ``sharding.py`` maps them to mesh axes.
Parameters are fp32; compute happens in ``ModelConfig.compute_dtype`` (bf16 by default).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import ROPE_SCALINGS, ModelConfig
from hybrid_lm.ops.norm import rms_norm


def param(rngs: nnx.Rngs, shape, axes, std: float, dtype=jnp.float32) -> nnx.Param:
    """A normally-initialised parameter with logical axis names."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), logical_axes=tuple(axes))


# Flax 0.12.12 deprecates sow() outside nnx.capture() and offers capture_noop=True (a no-op there);
# earlier 0.12 releases (the GPU image's) have no such argument and no deprecation.
_SOW_TAKES_NOOP = "capture_noop" in inspect.signature(nnx.Module.sow).parameters


def sow_intermediate(module: nnx.Module, name: str, value) -> None:
    """``module.sow(nnx.Intermediate, name, value)`` into the enclosing ``nnx.capture`` (the train step's);
    outside one (eval, generation) nothing is kept."""
    if _SOW_TAKES_NOOP:
        module.sow(nnx.Intermediate, name, value, capture_noop=True)
    else:
        module.sow(nnx.Intermediate, name, value)


def ones_param(shape, axes, dtype=jnp.float32) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), logical_axes=tuple(axes))


def out_proj_std(cfg: ModelConfig) -> float:
    """GPT-2 style: residual-branch output projections scaled by 1/sqrt(2 * n_layers)."""
    return cfg.init_std / (2 * cfg.n_layers) ** 0.5


class RMSNorm(nnx.Module):
    """``hybrid_lm.ops.norm.rms_norm`` with a learned fp32 scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = ones_param((dim,), ("norm",))
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), cfg.init_std)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), out_proj_std(cfg))

    def __call__(self, x):
        dt = x.dtype
        h = jax.nn.silu(x @ self.w_gate[...].astype(dt)) * (x @ self.w_up[...].astype(dt))
        return h @ self.w_down[...].astype(dt)


def rope_frequencies(head_dim: int, theta: float, scaling=None):
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32): ``theta ** (-2i / head_dim)``, rescaled
    by ``scaling`` (``hybrid_lm.config.ROPE_SCALINGS``), as transformers' ``ROPE_INIT_FUNCTIONS`` do.
    llama3: wavelengths below ``original / high_freq_factor`` keep their frequency, those above
    ``original / low_freq_factor`` are divided by ``factor``, and the band between interpolates linearly
    in ``original / wavelength``. linear: every frequency divided by ``factor``. yarn: frequency i is
    divided by ``factor`` below dimension index ``low`` ... kept above ``high``, where ``low`` / ``high``
    are the indices that turn ``beta_fast`` / ``beta_slow`` times over ``original`` positions (rounded
    outwards unless ``truncate`` is false), with a linear ramp between."""
    freqs = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    s = dict(scaling or {})
    if not s:
        return freqs
    kind, factor = s["rope_type"], s["factor"]
    if kind == "linear":
        return freqs / factor
    original = s["original_max_position_embeddings"]
    if kind == "yarn":
        def index(rotations):  # the dimension index whose wavelength fits ``rotations`` times into ``original``
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        # transformers reads beta_fast and beta_slow with `or` (null: the default) and truncate with `if`
        default = ROPE_SCALINGS["yarn"][1]
        low, high = index(s.get("beta_fast") or default["beta_fast"]), index(s.get("beta_slow") or default["beta_slow"])
        if s.get("truncate", default["truncate"]):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        kept = 1 - jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        return (freqs / factor * (1 - kept) + freqs * kept).astype(jnp.float32)
    lo, hi = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * jnp.pi / freqs
    smooth = (original / wavelen - lo) / (hi - lo)
    scaled = jnp.where(wavelen > original / lo, freqs / factor, freqs)
    between = (wavelen >= original / hi) & (wavelen <= original / lo)
    return jnp.where(between, (1 - smooth) * freqs / factor + smooth * freqs, scaled).astype(jnp.float32)


def rope_attention_factor(scaling=None) -> float:
    """The factor transformers multiplies RoPE's cos and sin by (so q and k each, their logits by its
    square): 1 but for yarn, where it is ``attention_factor`` if given, else ``0.1 ln(factor) + 1``
    (DeepSeek's ``mscale`` / ``mscale_all_dim``: the ratio of that form at each)."""
    s = dict(scaling or {})
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"])
    return mscale(s["factor"])


def apply_rope(x, positions, theta: float = 10000.0, scaling=None):
    """Rotary embedding (rotate-half convention) of ``x: [B, T, H, D]`` at ``positions: [B, T]``, at the
    frequencies of :func:`rope_frequencies` and scaled by :func:`rope_attention_factor` (``scaling``:
    ``MixerConfig.rope_scaling``, empty for plain RoPE)."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {D}")
    ang = positions.astype(jnp.float32)[..., None] * rope_frequencies(D, theta, scaling)  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    af = rope_attention_factor(scaling)
    if af != 1.0:
        cos, sin = cos * af, sin * af
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : D // 2], xf[..., D // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.table = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std)

    def __call__(self, ids, dtype):
        return jnp.take(self.table[...], ids, axis=0).astype(dtype)

    def attend(self, x):
        """Tied LM head: logits against the embedding table."""
        return x @ self.table[...].astype(x.dtype).T

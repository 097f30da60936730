"""GPU fast path of the linear-attention ops: jax-linear-attention's Mosaic GPU kernels behind our API.

One home for the fast path. :func:`simple_gla` and :func:`gated_delta_rule` take exactly the
arguments of :func:`hybrid_lm.ops.linear_attention.chunk_simple_gla` and
:func:`hybrid_lm.ops.delta_rule.chunk_gated_delta_rule` (fla conventions: ``[B, T, H, D]``, log-space
gates, ``scale`` default ``1/sqrt(Dk)``, fp32 states ``[B, H, Dk, Dv]`` in and out, outputs in q's
dtype), plus two keywords:

- ``impl``: ``"xla"`` is our chunked op (the portable path and the oracle); ``"jla"`` is
  jax-linear-attention's Hopper kernel (``jla.ops.linear_attention(kind, ..., impl="mosaic_gpu")``);
  ``"auto"`` picks ``"jla"`` when the default backend is a GPU, the package imports and its kernel
  accepts the call (its own ``supports`` predicate: sm_90, bf16/fp16 q/k/v of one dtype, head dims
  K, V in {64, 128}, and for the delta rule also (K, V) in {(128, 256), (256, 128..512)}, static
  scale), else ``"xla"`` (decided in :func:`linear_attention_backend`). An explicit
  ``"jla"`` that cannot run raises :class:`FastPathUnavailable` with the reason.
- grouped keys (:func:`simple_gla` only): ``q, k`` may have ``Hk`` heads dividing v's ``H`` (Mamba-2's
  B/C groups); value head ``h`` reads key head ``h // (H // Hk)``, as ``jnp.repeat(q, H // Hk, axis=2)``.
  The XLA path repeats them; on the jla path, with :data:`JLA_GROUPED_KEYS` on (the default), jla's
  kernel reads the groups itself (no ``[B, T, H, Dk]`` copies of q and k, and no sum over the
  repeated heads in the backward pass).
- ``kernel_dtype``: the dtype q, k and v are cast to *on the jla path only* (the layers pass their
  compute dtype, bf16). Mamba-2's ``v = x * dt`` and GDN's L2-normalised q, k are fp32 in the layers;
  the kernel takes bf16/fp16 only. The XLA path ignores it, so CPU numerics do not change. The output
  is cast back to q's dtype either way.

Conventions, ours -> jla (the conversions done in :func:`_jla_simple_gla` / :func:`_jla_gated_delta_rule`):

- layout: both ``[B, T, H, D]`` for q/k/v and ``[B, T, H]`` for gates; states ``[B, H, K, V]`` on both
  sides (jla transposes to ``[V, K]`` inside its kernels only). No transposes here.
- decay: both log space (``S_t = exp(g_t) S_{t-1} + ...``). Ours has an optional per-token ``g`` and an
  optional per-head constant ``g_gamma [H]`` that add up; jla's ``simple_gla`` has one required
  ``g [B, T, H]``. So ``g_jla = g + broadcast(g_gamma)``, or zeros when neither is given (no decay).
  Gradients reach ``g_gamma`` through the broadcast (a sum over B and T).
- scale: both multiply q, default ``1/sqrt(Dk)``; we pass the resolved value (jla needs a Python float).
- delta rule: same recurrence and argument order ``(q, k, v, g, beta)``; ``beta`` already sigmoided.
  q, k are used as given (``use_qk_l2norm=False``): normalising is the layer's job, as in our op.
- head widths: when the kernel rejects (Dk, Dv) but accepts wider ones, q and k are zero-padded to
  Dk' and v (and the initial state) to Dv', and the output / final state are sliced back. This is
  exact for both recurrences: zero key dims never write the state, zero value dims stay zero, zero
  query dims read nothing (the scale is resolved from the *unpadded* Dk first). It is what lets GDN at
  the preset scales (Dk = 96, Dv = 192) run the kernel at (128, 256), with 1.8x the state FLOPs.
- ``chunk_size`` and ``precision`` only steer our XLA scan; the kernel has a fixed 64-token chunk and
  its own fp32 accumulation (outputs agree up to rounding).

Multi-device: jla runs its kernels per shard inside ``shard_map`` over the context mesh
(``jax.set_mesh``, set by our train loop); we hand it our default logical rules, batch over
``("data", "fsdp")`` and heads over ``("tensor",)`` (any other axis of size > 1 also splits the batch or
the heads, jla's rule), so sharded activations are not all-gathered around the custom calls.

``jla`` is imported lazily (``pip install -e '.[gpu]'``); importing this module needs only JAX.
"""

from __future__ import annotations

import contextlib
import numbers
import functools

import jax
import jax.numpy as jnp

from hybrid_lm import backends
from hybrid_lm.backends import FastPathUnavailable, jla_available  # noqa: F401  (part of this API)
from hybrid_lm.backends import INSTALL_HINT, LINEAR_IMPLS, import_jla, no_gpu_reason, record_backend
from hybrid_lm.ops.delta_rule import _check_gates, chunk_gated_delta_rule
from hybrid_lm.ops.linear_attention import _check_qkv, _check_state, chunk_simple_gla

# jla's logical rules for splitting a kernel call over the context mesh, in our mesh axis names
# (MeshConfig.rules: batch -> data, fsdp; heads -> tensor).
JLA_SHARD_RULES = {"batch": ("data", "fsdp"), "heads": ("tensor",)}

# Hand grouped q, k (fewer heads than v) to jla's simple-GLA kernel as they are. Off: they are repeated to
# v's heads first. On: the GPU test (tests/gpu/test_gpu_linear.py) passes on the H200 and Mamba-2 steps are
# faster than with repeated keys (H200: S5 1878 -> 1813 ms, S3 468 -> 455 ms).
JLA_GROUPED_KEYS = True


def _check_grouped_qkv(q, k, v) -> int:
    """Checks ``q, k [B, T, Hk, Dk]`` and ``v [B, T, H, Dv]`` with ``Hk`` dividing ``H``; returns ``H // Hk``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
    if q.shape != k.shape or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"q, k must be [B, T, Hk, Dk] and v [B, T, H, Dv] with Hk dividing H: "
                         f"q{q.shape} k{k.shape} v{v.shape}")
    return v.shape[2] // q.shape[2]


def _repeat_keys(q, k, rep: int):
    """Grouped q, k repeated to one head per value head (value head h reads key head h // rep)."""
    return (q, k) if rep == 1 else (jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2))


def _jla_kernel_reason(op: str, q, k, v, gates: tuple, options: dict) -> str | None:
    """jla's own verdict on its Mosaic GPU kernel for this (converted) call: ``None`` if it runs it, else
    jla's reason. Uses jla's ``supports_*`` predicates (what its ``impl="auto"`` uses) and, for the
    message only, its ``unsupported_reason`` functions."""
    try:
        from jla.ops.mosaic_gpu import gated_delta_rule as jgdr  # the [gpu] extra
        from jla.ops.mosaic_gpu import scalar_gate as jsg  # the [gpu] extra
        from jla.ops.mosaic_gpu import scalar_gate_kb as jkb  # the [gpu] extra
    except ImportError:  # a JAX build without the Mosaic GPU toolchain registers no kernels
        return "this JAX build has no Mosaic GPU toolchain (jax.experimental.pallas.mosaic_gpu)"
    if op == "simple_gla":
        if jsg.supports_simple_gla(q, k, v, *gates, **options):
            return None
        reason = jsg.unsupported_reason(q, k, v, gates, options, delta=False)
    else:
        if jgdr.supports_gated_delta_rule(q, k, v, *gates, **options):
            return None
        reason = (jkb.unsupported_reason(q, k, v, gates, options) if jkb.handles(q, v)
                  else jsg.unsupported_reason(q, k, v, gates, options, delta=True))
    return reason or "rejected by jla's supports predicate"


KERNEL_WIDTHS = (64, 128, 256, 512)  # head widths tried when padding a call up to what the kernel takes


def _with_width(x, width):
    """A spec (or None) with its last axis replaced by ``width``."""
    return None if x is None else jax.ShapeDtypeStruct(x.shape[:-1] + (width,), x.dtype)


def kernel_widths(op: str, q, k, v, gates: tuple, *, scale=None, initial_state=None):
    """``(Dk', Dv')`` the jla kernel accepts for this call with q/k zero-padded to Dk' and v to Dv'
    (the unpadded widths first, then the cheapest padding), or ``None`` if none is accepted."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    cands = sorted({(a, b) for a in (Dk, *[w for w in KERNEL_WIDTHS if w > Dk])
                    for b in (Dv, *[w for w in KERNEL_WIDTHS if w > Dv])},
                   key=lambda ab: (ab != (Dk, Dv), ab[0] * ab[1], ab))
    for a, b in cands:
        state = None
        if initial_state is not None:
            state = jax.ShapeDtypeStruct(initial_state.shape[:2] + (a, b), initial_state.dtype)
        options = {"scale": scale, "initial_state": state}
        if _jla_kernel_reason(op, _with_width(q, a), _with_width(k, a), _with_width(v, b), gates, options) is None:
            return a, b
    return None


def kernel_reason(op: str, q, k, v, gates: tuple, *, scale=None, initial_state=None) -> str | None:
    """Why the jla kernel rejects this call (even with padded head widths); ``None`` if it takes it.

    ``op`` is ``"simple_gla"`` or ``"gated_delta_rule"``; q/k/v/gates are in jla's form (after the
    conversions below; arrays or ``jax.ShapeDtypeStruct``s). The platform and package checks come
    first, in :func:`jla_linear_reason`.
    """
    if kernel_widths(op, q, k, v, gates, scale=scale, initial_state=initial_state) is not None:
        return None
    return _jla_kernel_reason(op, q, k, v, gates, {"scale": scale, "initial_state": initial_state})


# ----------------------------------------------------------------------------- dispatch

def jla_linear_reason(op: str, q, k, v, gates: tuple, *, scale=None, initial_state=None,
                      platform: str | None = None) -> str | None:
    """Why the jla kernel cannot run this linear-attention call here (even with padded head widths);
    ``None`` if it can. ``op`` is ``"simple_gla"`` or ``"gated_delta_rule"``; q/k/v/gates in jla's form
    (arrays or ``jax.ShapeDtypeStruct``s, see ``hybrid_lm/ops/linear_attention_gpu.py``)."""
    if not backends.on_gpu(platform):
        return f"{no_gpu_reason(platform)} (the jla kernels need an sm_90 GPU)"
    if not backends.jla_available():
        return f"jax-linear-attention is not installed; {INSTALL_HINT}"
    if scale is not None and not isinstance(scale, numbers.Real):
        return f"scale must be a Python number for the kernel (it is static there), got {type(scale).__name__}"
    return kernel_reason(op, q, k, v, gates, scale=scale, initial_state=initial_state)


def linear_attention_backend(op: str, impl: str, q, k, v, gates: tuple, *, scale=None, initial_state=None,
                             platform: str | None = None) -> tuple[str, str]:
    """``(backend, reason)`` for one linear-attention call (``impl`` is ``linear_impl``): ``auto`` ->
    ``jla`` where its kernel accepts the call, else ``xla``. An explicit ``jla`` that cannot run raises
    :class:`FastPathUnavailable` (platform first, then package, then the call itself)."""
    if impl not in LINEAR_IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {LINEAR_IMPLS}")
    if impl == "xla":
        return "xla", "linear_impl='xla' set explicitly"
    if impl == "jla":
        if not backends.on_gpu(platform):
            raise FastPathUnavailable(f"impl='jla' needs a GPU (Hopper, sm_90); the default JAX backend is "
                                      f"{platform or backends.current_platform()!r}. Use impl='xla' or 'auto' here.")
        import_jla()
    reason = jla_linear_reason(op, q, k, v, gates, scale=scale, initial_state=initial_state, platform=platform)
    if reason is None:
        return "jla", f"{impl}: jla's Mosaic GPU kernel takes this call"
    if impl == "jla":
        raise FastPathUnavailable(f"impl='jla' cannot run {op}: {reason}")
    return "xla", f"auto: {reason}"


def _resolve(op: str, impl: str, q, k, v, gates, scale, initial_state, label: str | None = None) -> str:
    """'xla' or 'jla' for this call (:func:`linear_attention_backend`), recorded under
    ``label`` when given; raises :class:`FastPathUnavailable` for an explicit 'jla' that can't run."""
    which, reason = linear_attention_backend(op, impl, q, k, v, gates, scale=scale, initial_state=initial_state)
    if label is not None:
        record_backend(label, which, reason)
    return which


# ----------------------------------------------------------------------------- conventions: ours -> jla

def _to_jla_qkv(q, k, v, kernel_dtype):
    """q, k, v for the kernel: cast to ``kernel_dtype`` when given (our layers keep some of them in fp32;
    the kernel takes one bf16/fp16 dtype for all three). Layout is already jla's ``[B, T, H, D]``."""
    if kernel_dtype is None:
        return q, k, v
    dt = jnp.dtype(kernel_dtype)
    return q.astype(dt), k.astype(dt), v.astype(dt)


def _to_jla_log_decay(g, g_gamma, B, T, H):
    """Our optional ``g [B, T, H]`` + optional ``g_gamma [H]`` -> jla's one log decay ``g [B, T, H]`` (fp32).

    Both sides are log space (S <- exp(g) S); ours adds the two, so the sum is the total decay. Neither
    given means no decay: zeros. fp32 as our op computes the gates (jla reads g in its own dtype and
    returns dg in it).
    """
    out = None
    if g is not None:
        out = g.astype(jnp.float32)
    if g_gamma is not None:
        gam = jnp.broadcast_to(g_gamma.astype(jnp.float32)[None, None, :], (B, T, H))  # [H] -> [B, T, H]
        out = gam if out is None else out + gam
    return jnp.zeros((B, T, H), jnp.float32) if out is None else out


def _to_jla_state(initial_state):
    """Our fp32 ``[B, H, Dk, Dv]`` state is jla's ``[B, H, K, V]`` layout as is; make sure it is fp32."""
    return None if initial_state is None else initial_state.astype(jnp.float32)


def _resolved_scale(scale, Dk):
    """Both default to ``1/sqrt(Dk)`` and multiply q; pass the value explicitly (a Python float for jla)."""
    return Dk ** -0.5 if scale is None else float(scale)


def _pad_last(x, width):
    """Zero-pad the last axis to ``width`` (None passes through)."""
    if x is None or x.shape[-1] == width:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _pad_widths(q, k, v, initial_state, widths):
    """q, k to Dk' and v to Dv' (zeros); the state ``[B, H, Dk, Dv]`` on both of its last axes."""
    if widths is None:
        return q, k, v, initial_state
    a, b = widths
    if initial_state is not None:
        Dk = initial_state.shape[2]
        initial_state = _pad_last(jnp.pad(initial_state, ((0, 0), (0, 0), (0, a - Dk), (0, 0))), b)
    return _pad_last(q, a), _pad_last(k, a), _pad_last(v, b), initial_state


def _kernel_call_widths(op, jq, jk, jv, gates, scale, initial_state, backend, pad_to):
    """The widths to pad to: ``pad_to`` if given (tests), jla's choice for the kernel, else none."""
    if pad_to is not None or backend != "mosaic_gpu":
        return pad_to
    st = None if initial_state is None else _spec(initial_state, jnp.float32)
    widths = kernel_widths(op, _spec(jq), _spec(jk), _spec(jv), tuple(_spec(x) for x in gates),
                           scale=scale, initial_state=st)
    return None if widths == (jq.shape[-1], jv.shape[-1]) else widths


# jitted: identical calls (one per layer) lower, and compile their Mosaic GPU kernels, once per program
_JLA_STATIC = ("scale", "output_final_state", "kernel_dtype", "backend", "pad_to")


@contextlib.contextmanager
def _jla_rules():
    """jla's kernel sharding over our mesh axes (a no-op without a context mesh)."""
    try:
        from jla.distributed.kernel_sharding import use_rules  # the [gpu] extra
    except ImportError:
        yield
        return
    with use_rules(JLA_SHARD_RULES):
        yield


@functools.partial(jax.jit, static_argnames=(*_JLA_STATIC, "grouped_keys"))
def _jla_simple_gla(q, k, v, g, g_gamma, *, scale, initial_state, output_final_state, kernel_dtype=None,
                    backend: str = "mosaic_gpu", pad_to=None, grouped_keys: bool = False):
    """Our ``simple_gla`` call expressed in jla's API. ``backend`` is jla's ``impl``: ``mosaic_gpu`` (the
    kernel) or, for tests of the conversions on CPU, ``chunked`` / ``reference`` (jla's plain-JAX forms).
    ``pad_to=(Dk', Dv')`` forces zero-padded head widths (by default the kernel's choice, see
    :func:`kernel_widths`). ``grouped_keys`` hands grouped q, k to the kernel unrepeated (see
    :data:`JLA_GROUPED_KEYS`; static, so a compiled call never mixes the two)."""
    jla_ops = import_jla()
    B, T, _, Dk = q.shape
    H, Dv = v.shape[2:]
    if not (grouped_keys and backend == "mosaic_gpu"):  # jla's plain-JAX forms take one head count
        q, k = _repeat_keys(q, k, H // q.shape[2])
    out_dtype = q.dtype  # our contract: o comes back in q's dtype
    jscale = _resolved_scale(scale, Dk)  # from the unpadded width
    jq, jk, jv = _to_jla_qkv(q, k, v, kernel_dtype)
    jg = _to_jla_log_decay(g, g_gamma, B, T, H)
    js = _to_jla_state(initial_state)
    widths = _kernel_call_widths("simple_gla", jq, jk, jv, (jg,), jscale, js, backend, pad_to)
    jq, jk, jv, js = _pad_widths(jq, jk, jv, js, widths)
    with _jla_rules():
        o, S = jla_ops.linear_attention(
            "simple_gla", jq, jk, jv, impl=backend, g=jg, scale=jscale,
            initial_state=js, output_final_state=output_final_state)
    # jla returns o in the kernel input dtype and the final state in fp32 [B, H, K, V] (or None);
    # padded value columns / key rows are sliced off
    return o[..., :Dv].astype(out_dtype), (S[:, :, :Dk, :Dv].astype(jnp.float32) if output_final_state else None)


@functools.partial(jax.jit, static_argnames=(*_JLA_STATIC, "padded_output"))
def _jla_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, kernel_dtype=None,
                          backend: str = "mosaic_gpu", pad_to=None, padded_output: bool = False):
    """Our ``gated_delta_rule`` call expressed in jla's API (kind ``gated_deltanet``); see
    :func:`_jla_simple_gla` for ``backend`` and ``pad_to``. ``padded_output``: o as the kernel returns it
    (its dtype, its padded value width; see :func:`gated_delta_rule`)."""
    jla_ops = import_jla()
    Dk, Dv = q.shape[-1], v.shape[-1]
    out_dtype = q.dtype
    jscale = _resolved_scale(scale, Dk)  # from the unpadded width
    jq, jk, jv = _to_jla_qkv(q, k, v, kernel_dtype)
    # g: log decay [B, T, H] on both sides; beta: write strength in (0, 1) on both sides. fp32 gates.
    jg, jb = g.astype(jnp.float32), beta.astype(jnp.float32)
    js = _to_jla_state(initial_state)
    widths = _kernel_call_widths("gated_delta_rule", jq, jk, jv, (jg, jb), jscale, js, backend, pad_to)
    jq, jk, jv, js = _pad_widths(jq, jk, jv, js, widths)
    with _jla_rules():
        o, S = jla_ops.linear_attention(
            "gated_deltanet", jq, jk, jv, impl=backend, g=jg, beta=jb, scale=jscale, initial_state=js,
            output_final_state=output_final_state, use_qk_l2norm=False)  # q, k normalised by the caller
    S = S[:, :, :Dk, :Dv].astype(jnp.float32) if output_final_state else None
    return (o if padded_output else o[..., :Dv].astype(out_dtype)), S


# ----------------------------------------------------------------------------- public ops

def _spec(x, dtype=None):
    """Shape and dtype only: the resolvers decide from these, without computing casts."""
    return None if x is None else jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype or x.dtype))


def _qkv_specs(q, k, v, kernel_dtype):
    """q, k, v as :func:`_to_jla_qkv` would hand them to the kernel."""
    return tuple(_spec(x, kernel_dtype) for x in (q, k, v))


def resolve_simple_gla(q, k, v, g=None, g_gamma=None, *, scale=None, initial_state=None, impl: str = "auto",
                       kernel_dtype=None, label: str | None = None) -> str:
    """Which implementation :func:`simple_gla` runs for these arguments: ``'xla'`` or ``'jla'``
    (recorded under ``label`` when given).

    Raises :class:`FastPathUnavailable` for ``impl='jla'`` when the kernel cannot run the call here."""
    rep = _check_grouped_qkv(q, k, v)
    if rep > 1 and not JLA_GROUPED_KEYS:  # what the kernel is handed (_jla_simple_gla)
        q, k = (jax.ShapeDtypeStruct(x.shape[:2] + (v.shape[2],) + x.shape[3:], x.dtype) for x in (q, k))
    B, T, H = v.shape[:3]
    jg = jax.ShapeDtypeStruct((B, T, H), jnp.float32)  # the converted gate (_to_jla_log_decay)
    return _resolve("simple_gla", impl, *_qkv_specs(q, k, v, kernel_dtype), (jg,), scale,
                    _spec(initial_state, jnp.float32), label)


def resolve_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, impl: str = "auto",
                             kernel_dtype=None, label: str | None = None) -> str:
    """Which implementation :func:`gated_delta_rule` runs for these arguments: ``'xla'`` or ``'jla'``
    (recorded under ``label`` when given).

    Raises :class:`FastPathUnavailable` for ``impl='jla'`` when the kernel cannot run the call here."""
    _check_qkv(q, k, v)
    gates = (_spec(g, jnp.float32), _spec(beta, jnp.float32))
    return _resolve("gated_delta_rule", impl, *_qkv_specs(q, k, v, kernel_dtype), gates, scale,
                    _spec(initial_state, jnp.float32), label)


def simple_gla(q, k, v, g=None, g_gamma=None, *, scale: float | None = None, initial_state=None,
               output_final_state: bool = False, chunk_size: int = 64, precision=None, impl: str = "auto",
               kernel_dtype=None, label: str | None = None):
    """Scalar-decay linear attention; arguments and returns as :func:`chunk_simple_gla`, plus ``impl``
    (``auto`` | ``xla`` | ``jla``) and ``kernel_dtype`` (see the module docstring); the backend is
    recorded under ``label`` (``hybrid_lm.backends.record_backend``) when given.

    ``q, k`` may have fewer heads than ``v`` (grouped keys, see the module docstring).

    Returns ``(o [B, T, H, Dv] in q.dtype, final_state [B, H, Dk, Dv] float32 or None)``.
    """
    rep = _check_grouped_qkv(q, k, v)
    B, T, H = v.shape[:3]
    Dk = q.shape[-1]
    _check_state(initial_state, B, H, Dk, v.shape[-1])
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g must be [B, T, H] = {(B, T, H)}, got {g.shape}")
    if g_gamma is not None and g_gamma.shape != (H,):
        raise ValueError(f"g_gamma must be [H] = {(H,)}, got {g_gamma.shape}")
    which = resolve_simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state, impl=impl,
                               kernel_dtype=kernel_dtype, label=label)
    if which == "xla":
        q, k = _repeat_keys(q, k, rep)
        return chunk_simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, chunk_size=chunk_size, precision=precision)
    return _jla_simple_gla(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, kernel_dtype=kernel_dtype,
                           grouped_keys=JLA_GROUPED_KEYS)


def gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                     output_final_state: bool = False, chunk_size: int = 64, precision=None, impl: str = "auto",
                     kernel_dtype=None, label: str | None = None, padded_output: bool = False):
    """Gated delta rule; arguments and returns as :func:`chunk_gated_delta_rule` (q, k L2-normalised by the
    caller), plus ``impl`` (``auto`` | ``xla`` | ``jla``), ``kernel_dtype`` (see the module docstring) and
    ``label`` (as :func:`simple_gla`).

    Returns ``(o [B, T, H, Dv] in q.dtype, final_state [B, H, Dk, Dv] float32 or None)``. With
    ``padded_output`` the jla path returns o as its kernel wrote it, ``[B, T, H, Dv']`` with ``Dv' >= Dv``
    (padded value columns are zero) in the kernel's dtype, for a consumer that reads the first Dv columns
    in place (GDN's output norm) instead of a sliced, cast copy; the xla path returns o as usual.
    """
    _check_qkv(q, k, v)
    B, T, H, Dk = q.shape
    _check_gates(g, beta, B, T, H)
    _check_state(initial_state, B, H, Dk, v.shape[-1])
    which = resolve_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, impl=impl,
                                     kernel_dtype=kernel_dtype, label=label)
    if which == "xla":
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, chunk_size=chunk_size,
                                      precision=precision)
    return _jla_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state, kernel_dtype=kernel_dtype,
                                 padded_output=padded_output)

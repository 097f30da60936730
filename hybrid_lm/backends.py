"""Backend dispatch: which backend runs an op on this platform, and why.

One function per op family, each returning ``(backend, reason)``:

- :func:`attention_backend`: causal softmax attention (full, SWA, SA's permuted band), from
  ``ModelConfig.attention_impl``;
- :func:`moba_backend`: MoBA's block-sparse attention (the ``moba`` mixer and SSA's sparse stream);
- :func:`topk_method`: the top-k of the block selection (sort or argmax passes);
- :func:`sparse_decode_backend`: MoBA / SSA-sparse decoding (our kernels or the reference);
- :func:`loss_backend`: the next-token loss, whole or chunked logits (``ModelConfig.loss_impl``);
- :func:`loss_kernel_backend`: the chunked loss's softmax pass (Pallas on one GPU);
- :func:`conv_kernel_backend`: the short convs' backward in mamba2 / gdn (Pallas on one GPU).

The linear-attention ops dispatch beside their kernels (``ops.linear_attention_gpu``, from
``ModelConfig.linear_impl``), MoBA's selection and sparse kernel in ``model.moba``.

``platform`` is a JAX platform name (``"cpu"``, ``"gpu"``, ...), by default the default backend's. The
thresholds below were measured; ``docs/KERNELS.md`` ("Dispatch") has the table behind each.

Also the record of what the traced model's calls resolved to, filled while tracing (``record_backend``)
and read by the train loop into every metrics row (``attention_backends``); ``hybrid_lm.describe``
reads it per layer (``hybrid-lm info CONFIG --backends``).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from hybrid_lm import determinism
from hybrid_lm.errors import ConfigError

# SWA under ``auto`` on a GPU where jla's kernel cannot run: our Pallas kernel up to this window, cuDNN above.
PALLAS_SWA_MAX_WINDOW = 256
# cuDNN's fused attention takes these compute dtypes only (fp32 runs xla or our kernel under ``auto``).
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The next-token loss runs in token chunks under ``auto`` once whole fp32 logits would take this much.
CHUNKED_LOSS_MIN_BYTES = 2 ** 30
# MoBA's block-sparse kernel takes blocks that are powers of two from this size up.
MOBA_PALLAS_MIN_BLOCK = 16
# Selection top-k on a GPU: ``k`` argmax passes when k <= PASSES_MAX_K (the passes are unrolled) and
# there are at least PASSES_MIN_RATIO * k blocks to choose from; else XLA's sort-based top_k.
PASSES_MIN_RATIO = 16
PASSES_MAX_K = 32

TOPK_METHODS = ("auto", "sort", "passes")
LINEAR_IMPLS = ("auto", "xla", "jla")
INSTALL_HINT = "install it with `pip install -e '.[gpu]'` (package jax-linear-attention==0.1.0)"


# ----------------------------------------------------------------------------- platform

def current_platform() -> str:
    return jax.default_backend()


def on_gpu(platform: str | None = None) -> bool:
    return (platform or current_platform()) == "gpu"


def no_gpu_reason(platform: str | None) -> str:
    return f"no GPU: the default JAX backend is {platform or current_platform()!r}"


# ----------------------------------------------------------------------------- jax-linear-attention

class FastPathUnavailable(RuntimeError):
    """``impl='jla'`` was asked for but cannot run here (no GPU, no package, or an unsupported call)."""


def import_jla():
    """``jla.ops`` (lazily), or raise :class:`FastPathUnavailable` saying how to install it."""
    try:
        import jla.ops as jla_ops  # the [gpu] extra
    except ImportError as e:
        raise FastPathUnavailable(f"impl='jla' needs jax-linear-attention, which does not import ({e}); "
                                  f"{INSTALL_HINT}") from None
    return jla_ops


def jla_available() -> bool:
    try:
        import_jla()
    except FastPathUnavailable:
        return False
    return True


# ----------------------------------------------------------------------------- softmax attention

def jla_attention_reason(q, k, v, platform: str | None = None) -> str | None:
    """Why jax-linear-attention's causal/SWA kernel cannot take these operands here (arrays or
    ``jax.ShapeDtypeStruct``s); ``None`` if it can (sm_90, bf16/fp16, head dim 64/128, GQA)."""
    if not on_gpu(platform):
        return no_gpu_reason(platform)
    if not jla_available():
        return f"jax-linear-attention is not installed; {INSTALL_HINT}"
    try:
        from jla.ops.mosaic_gpu.attention import supported  # the [gpu] extra
    except ImportError as e:  # a JAX build without the Mosaic GPU toolchain
        return f"jla's Mosaic GPU attention does not import ({e})"
    return supported(q, k, v)


def attention_backend(impl: str, *, permuted: bool, window: int | None = None, qkv=None,
                      platform: str | None = None, segments: bool = False) -> tuple[str, str]:
    """``(backend, reason)`` for one causal attention call: ``impl`` is ``attention_impl``, ``permuted``
    marks SA's mask (causal by original position in a permuted order), ``window=None`` full attention,
    ``qkv`` the q, k, v arrays or shape structs (without them the jla kernel is not considered),
    ``segments`` a document mask (``DataConfig.document_mask``: only xla takes it).
    ``auto`` -> the fastest correct backend; an explicit choice that cannot run raises ConfigError."""
    if segments and impl != "xla":
        if impl == "auto":
            return "xla", f"auto: document_mask: {_NO_SEGMENTS}"
        raise ConfigError(f"attention_impl={impl!r} cannot mask documents (DataConfig.document_mask=True): "
                          f"{_NO_SEGMENTS}; use auto or xla")
    if impl == "auto":
        if not on_gpu(platform):
            return "xla", f"auto: {no_gpu_reason(platform)}"
        if permuted:
            return "pallas", "auto: only our kernel expresses SA's permuted mask"
        if determinism.active():
            return _deterministic_attention(qkv, platform)
        dtype = None if qkv is None else jnp.dtype(qkv[0].dtype)
        cudnn_ok = dtype is None or dtype in CUDNN_DTYPES
        if window is None:
            if cudnn_ok:
                return "cudnn", "auto: full causal attention runs cuDNN"
            return "xla", f"auto: cuDNN takes {', '.join(map(str, CUDNN_DTYPES))}, not {dtype}"
        jla_why = "no operands to check" if qkv is None else jla_attention_reason(*qkv, platform=platform)
        if jla_why is None:
            return "jla", "auto: jla's Mosaic GPU kernel takes these operands"
        if window <= PALLAS_SWA_MAX_WINDOW:
            return "pallas", f"auto: window {window} <= PALLAS_SWA_MAX_WINDOW={PALLAS_SWA_MAX_WINDOW} (not jla: {jla_why})"
        if not cudnn_ok:
            return "pallas", f"auto: cuDNN does not take {dtype}; our kernel takes any window (not jla: {jla_why})"
        return "cudnn", f"auto: window {window} > PALLAS_SWA_MAX_WINDOW={PALLAS_SWA_MAX_WINDOW} (not jla: {jla_why})"
    if impl in ("cudnn", "jla") and permuted:
        raise ConfigError(f"attention_impl={impl!r} cannot express stochastic attention's mask "
                          "(causal by original position in a permuted order); use pallas or xla")
    if impl == "jla" and qkv is not None and (reason := jla_attention_reason(*qkv, platform=platform)) is not None:
        raise ConfigError(f"attention_impl='jla' cannot run here: {reason}")
    return impl, f"attention_impl={impl!r} set explicitly"


# the reason's opening under deterministic ops
_DETERMINISTIC = "deterministic GPU ops (--xla_gpu_deterministic_ops), so not cuDNN"


def _deterministic_attention(qkv, platform: str | None) -> tuple[str, str]:
    """Full or windowed causal attention under XLA's deterministic GPU ops: never cuDNN, whose
    deterministic backward failed to run (``hybrid_lm/determinism.py``); jla's kernel where it takes the
    operands (its "ranged" backward is deterministic; full attention 0.91x cuDNN's speed at T = 32K,
    docs/KERNELS.md), else ours (no atomics in its backward)."""
    why = "no operands to check" if qkv is None else jla_attention_reason(*qkv, platform=platform)
    if why is None:
        return "jla", f"auto: {_DETERMINISTIC}; jla's kernel takes these operands (deterministic backward)"
    return "pallas", f"auto: {_DETERMINISTIC}; our kernel's backward uses no atomics (not jla: {why})"


# Why a document mask runs the XLA reference: what the other attention backends take.
_NO_SEGMENTS = ("only the XLA reference takes segment ids (jax.nn.dot_product_attention passes cuDNN no "
                "segment ids, only a dense O(T^2) mask; our Pallas kernels and jla's take none)")


def loss_backend(impl: str, n_tokens: int, vocab: int) -> tuple[str, str]:
    """``(backend, reason)`` of the next-token loss (``ModelConfig.loss_impl``): ``full`` (whole fp32
    logits) or ``chunked`` (``hybrid_lm.ops.cross_entropy.chunked_cross_entropy``, never more than a
    chunk of logits)."""
    whole = 4 * n_tokens * vocab
    if impl != "auto":
        return impl, f"loss_impl={impl!r} set explicitly"
    if whole >= CHUNKED_LOSS_MIN_BYTES:
        return "chunked", f"auto: whole logits {whole / 2 ** 30:.1f} GiB >= CHUNKED_LOSS_MIN_BYTES"
    return "full", f"auto: whole logits {whole / 2 ** 20:.1f} MiB < CHUNKED_LOSS_MIN_BYTES"


KERNEL_CHOICES = ("auto", "xla", "pallas")


def _row_kernel_backend(op: str, impl: str, platform: str | None, devices: int | None,
                        measured: str) -> tuple[str, str]:
    """``(backend, reason)`` of a row-wise Pallas kernel with an XLA reference. ``auto`` -> pallas on
    one GPU (``measured``: the win that earned it), xla elsewhere and on several devices (the kernels
    have no sharding rule: the partitioner would gather their sharded operands). ``xla`` / ``pallas``
    are for tests and benchmarks (``pallas`` on the CPU runs interpreted)."""
    if impl not in KERNEL_CHOICES:
        raise ValueError(f"{op} kernel {impl!r}: choose one of {KERNEL_CHOICES}")
    if impl != "auto":
        return impl, f"{op}: {impl!r} asked for"
    if not on_gpu(platform):
        return "xla", "auto: " + no_gpu_reason(platform)
    devices = jax.device_count() if devices is None else devices
    if devices > 1:
        return "xla", f"auto: {devices} devices (the kernel has no sharding rule)"
    return "pallas", f"auto: one GPU ({measured})"


def loss_kernel_backend(impl: str = "auto", platform: str | None = None, devices: int | None = None) -> tuple[str, str]:
    """``(backend, reason)`` of the chunked loss's softmax pass between the head's matmuls: ``pallas``
    (``hybrid_lm_kernels.softmax_xent_rows``, the logits read twice) or ``xla`` (the reference, three
    passes); ``auto``: pallas on one GPU (docs/KERNELS.md, "Loss softmax pass")."""
    return _row_kernel_backend("the loss's softmax pass", impl, platform, devices,
                               "train steps 0.95-0.99x the XLA pass's on an H200")


def conv_kernel_backend(impl: str = "auto", platform: str | None = None, devices: int | None = None) -> tuple[str, str]:
    """``(backend, reason)`` of the short convs' backward (``model.recurrent_common.short_conv``): ``pallas``
    (``hybrid_lm_kernels.short_conv_bwd``, x and dy read once) or ``xla`` (the jnp backward); ``auto``:
    pallas on one GPU (docs/KERNELS.md, "Short conv backward")."""
    return _row_kernel_backend("the short convs' backward", impl, platform, devices,
                               "train steps 0.978-0.984x the jnp backward's at S3/S5 Mamba-2 and GDN on an H200")


def attention_op_name(window: int | None, permuted: bool) -> str:
    """Label of one attention call in the record of backends, e.g. ``swa w=128``."""
    if window is None and not permuted:
        return "full"
    return f"{'sa' if permuted else 'swa'} w={window}"


# ----------------------------------------------------------------------------- block-sparse (MoBA, SSA)

def moba_backend(impl: str, block_size: int, platform: str | None = None) -> tuple[str, str]:
    """``(backend, reason)`` for MoBA's block-sparse attention: ``auto`` -> pallas on a GPU for
    power-of-two blocks >= MOBA_PALLAS_MIN_BLOCK, else xla (the reference takes any block)."""
    pow2 = block_size >= MOBA_PALLAS_MIN_BLOCK and not block_size & (block_size - 1)
    if impl == "auto":
        if not on_gpu(platform):
            return "xla", f"auto: {no_gpu_reason(platform)}"
        if pow2:
            return "pallas", f"auto: block {block_size} is a power of two >= {MOBA_PALLAS_MIN_BLOCK} (our kernel)"
        return "xla", (f"auto: block {block_size} is not a power of two >= {MOBA_PALLAS_MIN_BLOCK}, "
                       "which our kernel needs")
    if impl in ("cudnn", "jla"):
        raise ConfigError(f"attention_impl={impl!r} cannot express MoBA's block-sparse mask; "
                          "use auto, pallas or xla")
    if impl == "pallas" and not pow2:
        raise ConfigError(f"attention_impl='pallas' needs a MoBA block_size that is a power of two "
                          f">= {MOBA_PALLAS_MIN_BLOCK}, got {block_size}; use auto or xla "
                          "(the reference takes any block)")
    return impl, f"attention_impl={impl!r} set explicitly"


def topk_method(method: str, k: int, n: int, platform: str | None = None) -> tuple[str, str]:
    """``(method, reason)`` for the top-``k`` of ``n`` block scores per row: ``sort`` (``lax.top_k``)
    or ``passes`` (k argmax passes); ``auto`` -> passes on a GPU for k <= PASSES_MAX_K and
    n >= PASSES_MIN_RATIO * k, else sort."""
    if method not in TOPK_METHODS:
        raise ValueError(f"method={method!r}: choose one of {TOPK_METHODS}")
    if method != "auto":
        return method, f"method={method!r} set explicitly"
    if not on_gpu(platform):
        return "sort", f"auto: {no_gpu_reason(platform)}"
    if k <= PASSES_MAX_K and n >= PASSES_MIN_RATIO * k:
        return "passes", f"auto: k={k} <= {PASSES_MAX_K} and n={n} >= {PASSES_MIN_RATIO}k"
    return "sort", f"auto: k={k} > {PASSES_MAX_K} or n={n} < {PASSES_MIN_RATIO}k"


def sparse_decode_backend(platform: str | None = None) -> tuple[str, str]:
    """``(backend, reason)`` for one MoBA / SSA-sparse decoding read: ``pallas`` (the selection's
    top-k as the top-k kernel) on a GPU when the kernels import, else ``xla`` (the reference).
    Both gather only the selected blocks for the attention. Decoding has no ``attention_impl``:
    the platform decides."""
    if not on_gpu(platform):
        return "xla", f"auto: {no_gpu_reason(platform)}"
    try:
        import hybrid_lm_kernels  # noqa: F401  (whether the Pallas kernels import here)
    except ImportError as e:
        return "xla", f"auto: the Pallas kernels (hybrid_lm_kernels) do not import: {e}"
    return "pallas", "auto: GPU (top-k kernel: 0.003 ms against 0.033 for XLA's passes at S5, 128K, B 8, H200)"


# ----------------------------------------------------------------------------- linear attention

# ----------------------------------------------------------------------------- the record

# Backends the traced model's calls resolved to, e.g. {"full": "cudnn", "swa w=128": "jla",
# "moba block=128": "pallas", "lightning": "xla"}, and the reason for each.
_BACKENDS: dict[str, str] = {}
_REASONS: dict[str, str] = {}


def record_backend(op: str, backend: str, reason: str = "") -> None:
    _BACKENDS[op] = backend
    _REASONS[op] = reason


def recorded_backends(clear: bool = False) -> dict[str, str]:
    """The backends recorded since the last clear (a copy); ``clear=True`` empties the record."""
    out = dict(_BACKENDS)
    if clear:
        _BACKENDS.clear()
        _REASONS.clear()
    return out


def recorded_reasons() -> dict[str, str]:
    """The reason for each recorded backend (a copy)."""
    return dict(_REASONS)

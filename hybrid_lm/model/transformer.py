"""The hybrid language model: embedding, a stack of (mixer + SwiGLU) blocks from a layer pattern, head.

``ModelConfig.scan_layers`` runs the stack as one ``jax.lax.scan`` over repeated layer groups (one
period of the layer pattern, e.g. (full, efficient) for ``'1:1'``), so the compiled program holds
one group instead of every layer. The parameters keep their per-layer layout (the ``blocks`` list):
each call stacks the groups' variables leaf by leaf and scans one group's graph over them, so
checkpoints, parameter paths, logical axes and shapes are the same with or without it. Mixers that
depend on their layer index at call time read it from ``MixerContext.layer`` (traced under scan).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from hybrid_lm.config import ModelConfig
from hybrid_lm.model.layers import Embedding, RMSNorm, SwiGLU, param, sow_intermediate
from hybrid_lm.model.registry import MixerContext, check_document_mask, get_mixer
from hybrid_lm.ops.attention import default_positions

log = logging.getLogger(__name__)

# outputs of these primitives are attention kernels' forward results (output + softmax statistics,
# the residuals their backward reads): cuDNN fused attention and our Pallas kernels
_ATTENTION_KERNELS = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper", "pallas_call")
# values tagged with ``jax.ad_checkpoint.checkpoint_name`` that 'dots_attn' keeps: the sparse
# selection (int32, B x T x K x S), else recomputed in the backward pass with all its gate scores
SAVED_NAMES = ("sparse_selection",)


def _dots_and_attention_saveable(prim, *args, **params) -> bool:
    """``dots`` plus the attention kernels' forward outputs and the sparse selection: the backward pass then reuses the kernel's output and statistics, and the selected
    blocks, instead of running the attention forward and the selection a second time."""
    if prim.name in _ATTENTION_KERNELS:
        return True
    if prim.name == "name" and params.get("name") in SAVED_NAMES:
        return True
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params)


_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_attn": _dots_and_attention_saveable,
}


def pattern_period(layer_types: list[str]) -> int:
    """The shortest period of the per-layer types that tiles them (the scan's group size)."""
    n = len(layer_types)
    return next(p for p in range(1, n + 1) if n % p == 0 and layer_types == layer_types[:p] * (n // p))


def _structure(graphdef):
    """A block's graph definition with its layer index left out (static ``layer_idx`` attributes)."""
    if not hasattr(graphdef, "attributes"):  # another flax layout: compare whole (scan_plan then declines)
        return graphdef
    attrs = [(k, nnx.graph.Static(None)) if k == "layer_idx" else (k, a) for k, a in graphdef.attributes]
    return dataclasses.replace(graphdef, attributes=attrs)


class Block(nnx.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, layer_type: str, layer_idx: int, *, rngs: nnx.Rngs):
        mc = cfg.mixer(layer_type)
        self.layer_type = layer_type
        self.mixer_kind = mc.kind
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = get_mixer(mc.kind).cls(cfg, mc, layer_idx, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg, rngs=rngs)

    def __call__(self, x, ctx: MixerContext):
        x = x + self.mixer(self.mixer_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))

    # -- decode (mixers with ``prefill`` and ``step``: attention, swa, sa, sa_swa, moba, ssa, lightning, mamba2, gdn)

    def check_decode(self, layer_idx: int) -> None:
        if not (callable(getattr(self.mixer, "prefill", None)) and callable(getattr(self.mixer, "step", None))):
            raise NotImplementedError(
                f"layer {layer_idx}: mixer {self.mixer_kind!r} has no decode path (mixers with one: "
                "attention, swa, sa, sa_swa, moba, ssa, lightning, mamba2, gdn); score such models with `hybrid-lm eval`")

    def prefill(self, x, ctx: MixerContext, max_len: int):
        y, state = self.mixer.prefill(self.mixer_norm(x), ctx, max_len)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), state

    def step(self, x_t, state):
        y, state = self.mixer.step(self.mixer_norm(x_t), state)
        x_t = x_t + y
        return x_t + self.mlp(self.mlp_norm(x_t)), state


def model_parts(cfg: ModelConfig):
    """The model's parts in the order they draw from the ``params`` stream: ``(path, kind, build)``.
    ``build(rngs)`` makes the part; parts of one ``kind`` are built alike (the same parameters from
    the same stream position), so :class:`ParamInit` compiles one program per kind."""
    yield ("embed",), "embed", lambda rngs: Embedding(cfg, rngs=rngs)
    for i, t in enumerate(cfg.layer_types()):
        yield ("blocks", i), f"block/{t}", lambda rngs, t=t, i=i: Block(cfg, t, i, rngs=rngs)
    yield ("final_norm",), "final_norm", lambda rngs: RMSNorm(cfg.d_model, cfg.norm_eps)
    if not cfg.tie_embeddings:
        yield ("lm_head",), "lm_head", lambda rngs: param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"),
                                                          cfg.init_std)


class HybridLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        parts = {path: build(rngs) for path, _, build in model_parts(cfg)}
        self.embed = parts[("embed",)]
        self.blocks = nnx.List([parts[("blocks", i)] for i in range(cfg.n_layers)])
        self.final_norm = parts[("final_norm",)]
        if not cfg.tie_embeddings:
            self.lm_head = parts[("lm_head",)]

    def __call__(self, tokens, ctx: MixerContext | None = None, *, features: bool = False):
        """Logits (fp32) ``[B, T, vocab]`` for ``tokens [B, T]``; with ``features=True`` the final
        normed hidden state ``[B, T, d]`` instead (the head's input: ``logits = h @ head_matrix()``).
        ``ctx.segment_ids`` set (document masking): every layer must take it, else ConfigError."""
        cfg = self.cfg
        dtype = jnp.dtype(cfg.compute_dtype)
        if ctx is None:
            B, T = tokens.shape
            ctx = MixerContext(positions=default_positions(B, T))
        if ctx.segment_ids is not None:  # a refused mixer would ignore the segments: never silently
            check_document_mask(cfg, tokens.shape[1])
        x = self.run_blocks(self.embed(tokens, dtype), ctx)
        return self.final_norm(x) if features else self.logits(x)

    def _apply(self, block, x, ctx: MixerContext):
        if self.cfg.remat == "none":
            return block(x, ctx)
        return nnx.remat(lambda b, h: b(h, ctx), policy=_REMAT_POLICIES[self.cfg.remat])(block, x)

    def run_blocks(self, x, ctx: MixerContext):
        """The residual stream after every block: unrolled, or scanned under ``scan_layers``."""
        if self.cfg.scan_layers:
            period, reason = self.scan_plan()
            if reason is None:
                return self._scan_blocks(x, ctx, period)
            log.warning("scan_layers: running the layers unrolled (%s)", reason)
        for block in self.blocks:
            x = self._apply(block, x, ctx)
        return x

    def scan_plan(self) -> tuple[int, str | None]:
        """``(group size, None)`` when the blocks can be scanned, else ``(group size, why not)``."""
        n = len(self.blocks)
        period = pattern_period(self.cfg.layer_types())
        if n // period < 2:
            return period, f"the {n} layers form a single group of the layer pattern"
        first = [_structure(nnx.graphdef(b)) for b in self.blocks[:period]]
        for i in range(period, n):
            if _structure(nnx.graphdef(self.blocks[i])) != first[i % period]:
                return period, f"layer {i} is not built like layer {i % period}"
        return period, None

    def _scan_blocks(self, x, ctx: MixerContext, period: int):
        """``lax.scan`` over the ``n_layers // period`` groups. Values the blocks sow
        (``nnx.Intermediate``) are returned by the scan and sown again into each layer's own
        module, so ``nnx.capture`` sees the same tree as unrolled. Blocks must not update other
        variables in the forward pass (none does)."""
        n = len(self.blocks)
        groups = n // period
        split = [nnx.split(b) for b in self.blocks]
        graphdefs = [split[j][0] for j in range(period)]
        stacked = [jax.tree.map(lambda *a: jnp.stack(a), *[split[g * period + j][1] for g in range(groups)])
                   for j in range(period)]
        layers = jnp.arange(n, dtype=jnp.int32).reshape(groups, period)

        def body(h, xs):
            states, idx = xs
            sown = []
            for j in range(period):
                c = dataclasses.replace(ctx, layer=idx[j])
                block = nnx.merge(graphdefs[j], states[j])
                h, s = nnx.capture(lambda b, y: self._apply(b, y, c), nnx.Intermediate)(block, h)
                sown.append(s)
            return h, sown

        x, sown = jax.lax.scan(body, x, (stacked, layers))
        for j in range(period):
            for path, var in nnx.to_flat_state(sown[j]):
                values = var.get_value()
                if not isinstance(values, tuple):
                    raise NotImplementedError(f"scan_layers: {'/'.join(map(str, path))} was sown with a custom "
                                              "reduce_fn; only the default (a tuple of values) is supported")
                for g in range(groups):
                    module = self.blocks[g * period + j]
                    for key in path[:-1]:
                        module = module[key] if isinstance(key, int) else getattr(module, key)
                    for value in values:
                        sow_intermediate(module, path[-1], value[g])
        return x

    def head_matrix(self):
        """The LM head ``[d_model, vocab]`` (fp32 parameters; the embedding table's transpose when tied)."""
        return self.embed.table[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def logits(self, x):
        """fp32 logits from the last block's output ``x [..., d]``."""
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = x @ self.lm_head[...].astype(x.dtype)
        return logits.astype(jnp.float32)

    # -- decode: prefill a prompt, then one token at a time (hybrid_lm/eval/generate.py drives it)

    def prefill(self, tokens, max_len: int, attention_impl: str = "auto"):
        """Logits ``[B, T, vocab]`` of a prompt ``tokens [B, T]`` and the decode cache (one state per
        layer) for up to ``max_len`` positions in all."""
        for i, block in enumerate(self.blocks):
            block.check_decode(i)
        B, T = tokens.shape
        ctx = MixerContext(positions=default_positions(B, T), attention_impl=attention_impl, train=False)
        x = self.embed(tokens, jnp.dtype(self.cfg.compute_dtype))
        cache = []
        for block in self.blocks:
            x, state = block.prefill(x, ctx, max_len)
            cache.append(state)
        return self.logits(x), cache

    def decode_step(self, token, cache):
        """Logits ``[B, vocab]`` after one more token ``token [B]``, and the updated cache."""
        x = self.embed(token[:, None], jnp.dtype(self.cfg.compute_dtype))[:, 0]
        new = []
        for block, state in zip(self.blocks, cache):
            x, state = block.step(x, state)
            new.append(state)
        return self.logits(x), new


def init_params_reference(cfg: ModelConfig, seed) -> dict:
    """The plain init that :class:`ParamInit` equals: the whole model built at once (jit it for the
    same bits; op by op XLA rounds the scaled draws differently)."""
    return nnx.to_pure_dict(nnx.state(HybridLM(cfg, rngs=nnx.Rngs(params=jax.random.key(seed))), nnx.Param))


def _part_values(part):
    """A built part's parameters as a pure dict (a bare ``nnx.Param`` as its array)."""
    return part[...] if isinstance(part, nnx.Param) else nnx.to_pure_dict(nnx.state(part, nnx.Param))


class ParamInit:
    """``init(seed)``: the parameters of ``HybridLM(cfg, rngs=nnx.Rngs(params=jax.random.key(seed)))``,
    bit for bit, built part by part with one compiled program per kind of part.

    One program for the whole model holds every parameter's random draw: at S5 it took ~100 s to
    compile on the GPU host, twice the train step. Here each part (embedding, a block of each layer
    type, final norm, head) is a program of ``(seed, count) -> (parameters, count)``, where ``count``
    is the ``params`` stream's position (``nnx.Rngs`` draws ``fold_in(key, count)``), so identical
    blocks share one compile and the values equal the whole-model build's.

    ``shardings``: a tree like the parameters of ``NamedSharding`` (each part is created in its
    layout), or None. Call it eagerly, or inside a trace (``jax.eval_shape``); ``compile(seed)``
    compiles every program ahead of the first call.
    """

    def __init__(self, cfg: ModelConfig, shardings=None):
        self.cfg, self.shardings = cfg, shardings
        self._programs: dict = {}

    def _parts(self):
        for path, kind, build in model_parts(self.cfg):
            shard = self.shardings
            for k in path if shard is not None else ():
                shard = shard[k]
            key = (kind, tuple(jax.tree.leaves(shard)))
            if key not in self._programs:
                self._programs[key] = self._program(build, shard)
            yield path, self._programs[key]

    @staticmethod
    def _program(build, shard):
        def run(seed, count):
            rngs = nnx.Rngs(params=jax.random.key(seed))
            rngs.params.count[...] = count
            values = _part_values(build(rngs))
            return values, rngs.params.count[...]
        if shard is None:
            return jax.jit(run)
        repl = jax.sharding.NamedSharding(jax.tree.leaves(shard)[0].mesh, jax.sharding.PartitionSpec())
        return jax.jit(run, in_shardings=(repl, repl), out_shardings=(shard, repl))

    def _start(self, seed):
        return jnp.asarray(seed, jnp.uint32), jnp.zeros((), jnp.uint32)

    def __call__(self, seed) -> dict:
        seed, count = self._start(seed)
        params: dict = {}
        for path, program in self._parts():
            values, count = program(seed, count)
            node = params
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = values
        return params

    def compile(self, seed) -> None:
        """Compile every part's program (a later call then starts at once)."""
        seed, count = self._start(seed)
        for program in {id(p): p for _, p in self._parts()}.values():
            program.lower(seed, count).compile()

"""Compile time: a kernel called by every layer is lowered (and its Triton kernel compiled) once per
program, not once per layer. The kernels' entry points are jitted; a model exported for CUDA has the
same Triton custom calls at 2 and at 8 layers (before: 6 and 24 for SA). And no per-layer constant is
folded by XLA into an array of the activations' size (Lightning's decay)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY, triton_calls_for_cuda

from hybrid_lm.experiment import load_config
from hybrid_lm.step import ModelFns


def _triton_calls(n_layers: int, mixer: list[str]) -> int:
    cfg = load_config([], TINY + mixer + [f"ModelConfig.n_layers = {n_layers}", "ModelConfig.attention_impl = 'pallas'",
                                          "DataConfig.seq_len = 256"])
    fns = ModelFns(cfg)
    grad = jax.jit(jax.grad(lambda p, t: fns.loss(p, t, 0, jnp.arange(2))[0]))
    return triton_calls_for_cuda(grad, jax.eval_shape(fns.init, 0), jax.ShapeDtypeStruct((2, 257), jnp.int32))


@pytest.mark.integration  # whole models compiled
@pytest.mark.parametrize("mixer", [
    ["efficient/MixerConfig.kind = 'sa'"],
    # per-head gate: the union kernel; the ssa gate (shared by the GQA group): the gather kernel
    ["efficient/MixerConfig.kind = 'moba'",
     "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 4, 'gate': 'moba'}"],
    ["efficient/MixerConfig.kind = 'moba'", "efficient/MixerConfig.options = {'block_size': 16, 'top_k': 4}"],
], ids=["sa", "moba-union", "moba-gather"])
def test_kernels_lower_once_per_program_not_per_layer(mixer):
    shallow, deep = _triton_calls(2, mixer), _triton_calls(8, mixer)
    assert shallow > 0 and deep == shallow, (shallow, deep)


def _largest_constant(hlo: str) -> int:
    """Elements of the largest array constant in an optimised HLO text (a folded computation shows as one)."""
    import math
    import re
    sizes = [math.prod(int(d) for d in dims.split(",") if d) for dims in
             re.findall(r"= \w+\[([\d,]*)\]\{?[^}]*\}? constant\(", hlo)]
    return max(sizes, default=0)


@pytest.mark.integration  # whole models compiled
def test_lightning_decay_is_not_folded_into_a_constant():
    """Lightning's per-layer decay is a constant; XLA would fold its [B, T, H] broadcast cumsum at
    compile time, once per layer, in its interpreter (minutes at S5). Behind an optimization barrier
    no constant of the activations' size is left in the compiled program."""
    B, T = 5, 128
    cfg = load_config([], TINY + ["efficient/MixerConfig.kind = 'lightning'", "efficient/MixerConfig.window = None",
                                  "efficient/MixerConfig.options = {'chunk_size': 16}", f"DataConfig.seq_len = {T}"])
    fns = ModelFns(cfg)
    grad = jax.jit(jax.grad(lambda p, t: fns.loss(p, t, 0, jnp.arange(B))[0]))
    hlo = grad.lower(jax.eval_shape(fns.init, 0), jax.ShapeDtypeStruct((B, T + 1), jnp.int32)).compile().as_text()
    assert _largest_constant(hlo) < B * T, _largest_constant(hlo)

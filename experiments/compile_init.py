"""Compile time of the parameter init: the whole model in one program against ParamInit's parts.

    python experiments/compile_init.py --scale s5 --arch full,lightning,gdn --whole full,lightning --out init.json

For each arch, ``ParamInit(cfg).compile(seed)`` (one program per kind of part: embedding, a block
per layer type, final norm, head) is timed; for the archs in ``--whole`` also the single program
that builds the whole model under ``jax.jit`` (the trainer's init before ParamInit). Where both
ran, the two parameter trees are computed on the device and compared bit for bit (``equal``).
Prints a table and writes JSON after every row, so a run cut off by its time limit keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from bench_train import ARCH, make_config
from hybrid_lm.model.transformer import ParamInit, init_params_reference


def measure(scale: str, arch: str, whole: bool, seed) -> dict:
    cfg = make_config(scale, arch, 16384, 1, "dots_attn", "auto").model
    init = ParamInit(cfg)
    t0 = time.perf_counter()
    init.compile(seed)
    row = {"scale": scale, "arch": arch, "parts_compile_s": time.perf_counter() - t0,
           "programs": len({id(p) for p in init._programs.values()}), "layers": cfg.n_layers}
    t0 = time.perf_counter()
    parts = jax.block_until_ready(init(seed))
    row["parts_run_s"] = time.perf_counter() - t0
    if whole:
        ref = jax.jit(lambda s: init_params_reference(cfg, s))  # every draw in one program
        t0 = time.perf_counter()
        compiled = ref.lower(seed).compile()
        row["whole_compile_s"] = time.perf_counter() - t0
        expected = compiled(seed)
        row["equal"] = jax.tree.structure(parts) == jax.tree.structure(expected) and all(
            bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(parts), jax.tree.leaves(expected)))
        del expected
    del parts
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="s5", help="comma-separated scales")
    ap.add_argument("--arch", default="full,swa,sa,sa_swa,lightning,mamba2,gdn", help="comma-separated bench_train archs")
    ap.add_argument("--whole", default="", help="archs whose whole-model init program is compiled too")
    ap.add_argument("--out", default="compile_init.json")
    args = ap.parse_args(argv)
    archs, whole = args.arch.split(","), set(filter(None, args.whole.split(",")))
    for a in archs + sorted(whole):
        if a not in ARCH:
            raise SystemExit(f"unknown arch {a!r}: choose from {sorted(ARCH)}")
    seed = jnp.asarray(0, jnp.uint32)
    rows = []
    print(f"{'scale':<6}{'arch':<11}{'layers':>7}{'programs':>9}{'parts s':>9}{'whole s':>9}{'ratio':>7}  equal")
    for scale in args.scale.split(","):
        for arch in archs:
            r = measure(scale, arch, arch in whole, seed)
            rows.append(r)
            w = r.get("whole_compile_s")
            print(f"{scale:<6}{arch:<11}{r['layers']:>7}{r['programs']:>9}{r['parts_compile_s']:>9.1f}"
                  + (f"{w:>9.1f}{w / r['parts_compile_s']:>7.1f}  {r['equal']}" if w else f"{'':>9}{'':>7}  -"),
                  flush=True)
            with open(args.out, "w") as fh:
                json.dump({"device": jax.devices()[0].device_kind, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "rows": rows}, fh, indent=2)
    if any(r.get("equal") is False for r in rows):
        raise SystemExit("ParamInit's values differ from the whole-model init")


if __name__ == "__main__":
    main()

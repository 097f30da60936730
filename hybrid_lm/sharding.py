"""Device mesh, logical-axis sharding rules, batch placement and optimizer-state shardings.

Mesh axes are ``data``, ``fsdp`` and ``tensor`` (``AxisType.Auto``, made explicit). Every parameter
names its logical axes; ``MeshConfig.rules`` maps each logical axis to a mesh axis (or None).
A dimension that a mesh axis does not divide is replicated instead.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from hybrid_lm.errors import ConfigError

from hybrid_lm.config import MeshConfig

MESH_AXES = ("data", "fsdp", "tensor")


def make_mesh(mc: MeshConfig, devices=None) -> jax.sharding.Mesh:
    devices = list(devices if devices is not None else jax.devices())
    sizes = [mc.data, mc.fsdp, mc.tensor]
    if sizes.count(-1) > 1:
        raise ConfigError("at most one MeshConfig axis may be -1")
    fixed = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % fixed:
            raise ConfigError(f"{len(devices)} devices cannot be split into mesh axes {sizes}")
        sizes[sizes.index(-1)] = len(devices) // fixed
    if int(np.prod(sizes)) != len(devices):
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}")
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _mesh_axes_for(logical: str | None, rules: dict):
    if logical is None:
        return None
    if logical not in rules:
        raise ConfigError(f"logical axis {logical!r} has no rule in MeshConfig.rules")
    return rules[logical]


def logical_to_spec(axes: tuple, shape: tuple, mesh, rules) -> P:
    """PartitionSpec for a parameter with logical ``axes`` and ``shape`` under ``rules``."""
    rules = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(axes, shape):
        target = _mesh_axes_for(name, rules)
        names = (target,) if isinstance(target, str) else tuple(target or ())
        names = tuple(n for n in names if n not in used and mesh.shape[n] > 1)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        if not names or dim % size:
            spec.append(None)
            continue
        used.update(names)
        spec.append(names[0] if len(names) == 1 else names)
    return P(*spec)


def tree_shardings(axes_tree, abstract_tree, mesh, rules):
    """NamedShardings for a tree of parameters given a parallel tree of logical axes."""
    return jax.tree.map(lambda axes, leaf: NamedSharding(mesh, logical_to_spec(axes, leaf.shape, mesh, rules)),
                        axes_tree, abstract_tree, is_leaf=lambda x: isinstance(x, tuple))


def batch_sharding(mesh, rules) -> NamedSharding:
    target = dict(rules).get("batch", ("data", "fsdp"))
    names = (target,) if isinstance(target, str) else tuple(target or ())
    return NamedSharding(mesh, P(names or None, None))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def n_batch_shards(mesh) -> int:
    """How many ways a batch is split (the ``data`` x ``fsdp`` axes)."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def local_rows(sharding, global_shape) -> slice:
    """The contiguous rows of a batch-sharded global array that this process feeds."""
    idx = sharding.addressable_devices_indices_map(global_shape).values()
    starts = [(i[0].start or 0) for i in idx]
    stops = [(i[0].stop if i[0].stop is not None else global_shape[0]) for i in idx]
    return slice(min(starts), max(stops))


def put_batch(batch, sharding):
    """A host batch (the same global array on every process) placed as a global array; a dict of
    such arrays (``{"tokens", "segment_ids"}``, rows aligned) as a dict of global arrays."""
    def put(a: np.ndarray):
        rows = local_rows(sharding, a.shape)
        return jax.make_array_from_process_local_data(sharding, a[rows], a.shape)
    return {k: put(a) for k, a in batch.items()} if isinstance(batch, dict) else put(batch)


def put_local_batch(local, sharding, global_shape: tuple[int, ...]):
    """This process's rows (``local_rows(sharding, global_shape)`` of the global batch, as
    ``DataStreams.batch(step, rows)`` reads them) placed as a global array (or a dict of them)."""
    def put(a: np.ndarray):
        return jax.make_array_from_process_local_data(sharding, a, (global_shape[0], *a.shape[1:]))
    return {k: put(a) for k, a in local.items()} if isinstance(local, dict) else put(local)


def match_opt_shardings(abstract_opt, abstract_params, p_shard, default):
    """Optimizer leaves whose path ends in a parameter's path (moments) take that parameter's sharding;
    the rest (step counts) keep ``default``."""
    by_path = {}
    for (path, leaf), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(p_shard)):
        by_path[tuple(map(str, path))] = (leaf.shape, s)

    def pick(path, leaf, dflt):
        keys = tuple(map(str, path))
        for i in range(len(keys)):
            hit = by_path.get(keys[i:])
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return dflt

    return jax.tree_util.tree_map_with_path(pick, abstract_opt, default)

"""Training-free attention swaps and receptive-field constraints, evaluated on a run's checkpoint.

A trained run directory (``config.json`` + ``checkpoints/``) is evaluated, without retraining, with

- its attention layers switched to another attention mixer: a slot (``full`` or ``efficient``)
  becomes ``swa`` / ``sa`` at window w, ``moba`` at a key budget w (= top_k x block_size), full
  ``attention``, or ``attention_sink``. These mixers all hold exactly the parameters of
  :class:`hybrid_lm.model.attention.Attention` (wq, wk, wv, wo), so the checkpoint loads unchanged.
  Every swap is checked against the checkpoint's parameter tree before anything is restored: a swap
  whose parameters differ (e.g. to or from ``sa_swa``, which adds gates, or a recurrent mixer) is
  refused with a :class:`SwapError` naming the layers and parameters;
- its full-attention layers limited to the last H tokens plus S sink tokens (the Rethinking paper's
  receptive-field constraint, ``eval_sliding_window`` / ``eval_attention_sink_size``): the full slot
  becomes ``attention_sink`` with ``{'horizon': H, 'sinks': S}`` (``model/constrained_attention.py``).

The metrics are the trainer's: mean next-token cross-entropy and bits/byte on the run's fixed eval
windows (``DataStreams.eval_batch``), batched exactly as ``train/loop.py`` does, so the unswapped
evaluation of the final checkpoint reproduces the trainer's final eval loss. A different
``seq_len`` cuts the same validation split into windows of that length. Every evaluation appends a
row (settings, checkpoint step, metrics) to ``<workdir>/eval.jsonl``.

Python: ``SwapEvaluator(workdir).evaluate(swaps=['full=swa:128'], horizon=..., sinks=...)`` restores
once and evaluates any number of settings; CLI: ``hybrid-lm eval WORKDIR --swap full=swa:128``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from hybrid_lm.config import Config, MixerConfig, ModelConfig, config_from_dict
from hybrid_lm.errors import ConfigError
from hybrid_lm.model.registry import get_mixer

log = logging.getLogger(__name__)

SLOTS = {"full": "full", "f": "full", "efficient": "efficient", "e": "efficient"}
SLOT_LETTER = {"full": "F", "efficient": "E"}


class SwapError(ConfigError):
    """A swap or constraint that cannot be applied to this checkpoint; the message says why."""


# ----------------------------------------------------------------------------- swap specs

@dataclass(frozen=True)
class Swap:
    """``SLOT=KIND[:W][,key=value...]``, e.g. ``full=swa:128``, ``efficient=sa:64,eval_draws=4``,
    ``full=moba:256,block_size=32,gate=moba``, ``full=attention_sink:512,sinks=4``.

    W is the window for windowed mixers (``swa``, ``sa``, ...), the key budget ``top_k * block_size``
    for block-sparse ones (``moba``: top_k = W / block_size), the horizon for ``attention_sink``; full
    ``attention`` takes none. ``key=value`` pairs are mixer options (values parsed as Python/JSON
    literals, else kept as strings).
    """

    slot: str
    kind: str
    size: int | None = None
    options: tuple = ()  # ((key, value), ...) in the order given
    spec: str = ""

    def to_dict(self) -> dict:
        return {"slot": self.slot, "kind": self.kind, "size": self.size, "options": dict(self.options),
                "spec": self.spec}


def _literal(text: str):
    for parse in (ast.literal_eval, json.loads):
        try:
            return parse(text)
        except (ValueError, SyntaxError, json.JSONDecodeError):
            pass
    return text


def parse_swap(spec: str) -> Swap:
    if not isinstance(spec, str) or "=" not in spec:
        raise SwapError(f"swap {spec!r}: expected SLOT=KIND[:W][,key=value...], e.g. full=swa:128")
    slot_text, rest = spec.split("=", 1)
    slot = SLOTS.get(slot_text.strip().lower())
    if slot is None:
        raise SwapError(f"swap {spec!r}: slot {slot_text!r} must be 'full' or 'efficient'")
    head, *pairs = [p.strip() for p in rest.split(",")]
    kind, _, size_text = head.partition(":")
    kind = kind.strip()
    if not kind:
        raise SwapError(f"swap {spec!r}: no mixer kind after '{slot_text}='")
    size = None
    if size_text:
        try:
            size = int(size_text)
        except ValueError:
            raise SwapError(f"swap {spec!r}: W={size_text!r} must be an integer") from None
        if size < 1:
            raise SwapError(f"swap {spec!r}: W={size} must be >= 1")
    options = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise SwapError(f"swap {spec!r}: option {pair!r} must look like key=value")
        options.append((key.strip(), _literal(value.strip())))
    return Swap(slot, kind, size, tuple(options), spec)


def _size_meaning(kind: str) -> str | None:
    """What W means for a mixer kind: 'window', 'budget', 'horizon' or None (takes no W)."""
    if kind == "attention":
        return None
    if kind == "attention_sink":
        return "horizon"
    opts = get_mixer(kind).options
    names = {f.name for f in dataclasses.fields(opts)} if opts is not None else set()
    if {"block_size", "top_k"} <= names:
        return "budget"
    return "window"


def swapped_mixer(old: MixerConfig, swap: Swap) -> MixerConfig:
    """The slot's mixer config after the swap. RoPE / NoPE settings are kept (same parameters, same
    positional encoding); options start from the trained ones only when the kind is unchanged."""
    spec = get_mixer(swap.kind)  # unknown kind -> ConfigError listing the registered ones
    options = dict(old.options) if swap.kind == old.kind else {}
    options.update(dict(swap.options))
    window = old.window if swap.kind == old.kind else None
    meaning = _size_meaning(swap.kind)
    if swap.size is not None:
        if meaning is None:
            raise SwapError(f"swap {swap.spec!r}: {swap.kind!r} takes no window or budget; drop ':{swap.size}'")
        if meaning == "window":
            window = swap.size
        elif meaning == "horizon":
            options["horizon"] = swap.size
        else:  # budget = top_k * block_size
            block = options.get("block_size", getattr(spec.options(), "block_size"))
            if not isinstance(block, int) or block < 1 or swap.size % block:
                raise SwapError(f"swap {swap.spec!r}: the key budget {swap.size} must be a positive multiple "
                                f"of block_size={block!r} (budget = top_k * block_size)")
            top_k = swap.size // block
            if "top_k" in dict(swap.options) and dict(swap.options)["top_k"] != top_k:
                raise SwapError(f"swap {swap.spec!r}: top_k={dict(swap.options)['top_k']} contradicts the "
                                f"budget {swap.size} / block_size {block} = {top_k}")
            options["top_k"] = top_k
    if meaning == "window" and window is None and spec.needs_window:
        raise SwapError(f"swap {swap.spec!r}: {swap.kind!r} needs a window: {swap.slot}={swap.kind}:W")
    if meaning != "window":
        window = None
    mc = dataclasses.replace(old, kind=swap.kind, window=window, options=options)
    spec.check_config(mc, swap.slot)  # bad options -> ConfigError
    return mc


def apply_swaps(model: ModelConfig, swaps=(), horizon: int | None = None, sinks: int = 0) -> ModelConfig:
    """The model config with the swaps and the receptive-field constraint applied (validated)."""
    swaps = [parse_swap(s) if isinstance(s, str) else s for s in swaps]
    types = set(model.layer_types())
    slots = {}
    for s in swaps:
        if s.slot in slots:
            raise SwapError(f"two swaps for the {s.slot} slot: {slots[s.slot].spec!r} and {s.spec!r}")
        if SLOT_LETTER[s.slot] not in types:
            raise SwapError(f"swap {s.spec!r}: the model has no {s.slot} layers (layer pattern "
                            f"{model.layer_pattern!r} = {''.join(model.layer_types())})")
        slots[s.slot] = s
    new = {slot: swapped_mixer(getattr(model, slot), s) for slot, s in slots.items()}
    model = dataclasses.replace(model, **new)
    if sinks and horizon is None:
        raise SwapError(f"sinks={sinks} needs a horizon: the sinks are kept in addition to the last H tokens")
    if horizon is not None:
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise SwapError(f"horizon={horizon!r} must be an int >= 1 (it counts the query itself)")
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise SwapError(f"sinks={sinks!r} must be an int >= 0")
        if "F" not in types:
            raise SwapError(f"--horizon constrains the full-attention layers, and layer pattern "
                            f"{model.layer_pattern!r} has none")
        if model.full.kind != "attention":
            how = f"after swap {slots['full'].spec!r}" if "full" in slots else "in this run"
            raise SwapError(f"--horizon constrains full-attention layers, but the full slot is "
                            f"{model.full.kind!r} {how}; for an explicit setting use "
                            f"--swap full=attention_sink:H,sinks=S")
        full = dataclasses.replace(model.full, kind="attention_sink", window=None,
                                   options={"horizon": horizon, "sinks": sinks})
        get_mixer("attention_sink").check_config(full, "full")
        model = dataclasses.replace(model, full=full)
    return model


# ----------------------------------------------------------------------------- parameter check

def _flat_shapes(tree) -> dict[str, tuple]:
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = tuple(leaf.shape)
    return out


def check_params_match(trained: Config, swapped: Config) -> None:
    """Raise :class:`SwapError` unless the swapped model's parameters are the checkpoint's (same
    paths, shapes and dtypes)."""
    from hybrid_lm.train.step import ModelFns

    a = _flat_shapes(ModelFns(trained).abstract_params)
    b = _flat_shapes(ModelFns(swapped).abstract_params)
    if a == b:
        return
    problems = []
    for p in sorted(set(a) - set(b)):
        problems.append(f"{p}: in the checkpoint, not taken by the swapped model")
    for p in sorted(set(b) - set(a)):
        problems.append(f"{p}: needed by the swapped model, not in the checkpoint")
    for p in sorted(set(a) & set(b)):
        if a[p] != b[p]:
            problems.append(f"{p}: shape {a[p]} in the checkpoint, {b[p]} in the swapped model")
    tm, sm = trained.model, swapped.model
    kinds = ", ".join(f"{slot} {getattr(tm, slot).kind} -> {getattr(sm, slot).kind}"
                      for slot in ("full", "efficient") if getattr(tm, slot).kind != getattr(sm, slot).kind)
    shown = "\n  ".join(problems[:12]) + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else "")
    raise SwapError(f"the swap ({kinds or 'options only'}) changes the parameters, so the checkpoint cannot "
                    f"be loaded unchanged; training-free swaps are between mixers with attention's "
                    f"parameters (attention, swa, sa, moba, attention_sink):\n  {shown}")


# ----------------------------------------------------------------------------- evaluation

def swapped_config(cfg: Config, swaps=(), horizon: int | None = None, sinks: int = 0, *,
                   seq_len: int | None = None, eval_windows: int | None = None,
                   attention_impl: str | None = None) -> Config:
    """The run's config with swaps, constraint and eval overrides applied, validated, and checked to
    take the checkpoint's parameters unchanged (nothing is restored or allocated)."""
    from hybrid_lm.config import validate_config

    model = apply_swaps(cfg.model, swaps, horizon, sinks)
    if attention_impl is not None:
        model = dataclasses.replace(model, attention_impl=attention_impl)
    data = cfg.data
    if seq_len is not None:
        data = dataclasses.replace(data, seq_len=int(seq_len))
    if eval_windows is not None:
        data = dataclasses.replace(data, eval_windows=int(eval_windows))
    new = dataclasses.replace(cfg, model=model, data=data)
    validate_config(new)
    check_params_match(cfg, new)
    return new


def describe(model: ModelConfig) -> dict:
    return {slot: {"kind": mc.kind, "window": mc.window, "options": dict(mc.options), "rope": mc.rope}
            for slot, mc in (("full", model.full), ("efficient", model.efficient))}


def load_run_config(workdir: Path | str) -> Config:
    path = Path(workdir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{workdir} is not a run directory: no config.json")
    return config_from_dict(json.loads(path.read_text()))


class SwapEvaluator:
    """Restores a run's checkpoint once; :meth:`evaluate` runs any number of swap settings on it."""

    def __init__(self, workdir: Path | str, *, step: int | None = None, devices=None):
        from hybrid_lm.train import sharding as shd
        from hybrid_lm.train.step import ModelFns

        self.workdir = Path(workdir)
        self.cfg = load_run_config(self.workdir)
        try:
            self.mesh = shd.make_mesh(self.cfg.mesh, devices)
        except ConfigError as e:  # trained on another topology: evaluate data-parallel on what is here
            log.warning("the run's mesh does not fit these devices (%s); evaluating data-parallel", e)
            self.mesh = shd.make_mesh(dataclasses.replace(self.cfg.mesh, data=-1, fsdp=1, tensor=1), devices)
        self.rules = self.cfg.mesh.rules
        fns = ModelFns(self.cfg)
        self.p_shard = shd.tree_shardings(fns.axes, fns.abstract_params, self.mesh, self.rules)
        self.batch_shard = shd.batch_sharding(self.mesh, self.rules)
        self.n_batch_shards = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        self.params, self.step = self._restore(fns, step)
        self._data = {}

    def _restore(self, fns, step: int | None):
        """Parameters only (no optimizer state) of ``step``, or of the newest checkpoint that restores."""
        import orbax.checkpoint as ocp

        from hybrid_lm.train.checkpoint import Checkpointer, abstract_with_shardings

        directory = self.workdir / "checkpoints"
        if not directory.is_dir():
            raise FileNotFoundError(f"{self.workdir} has no checkpoints/ directory")
        ckpt = Checkpointer(directory, self.cfg.checkpoint)
        try:
            steps = ckpt.all_steps()
            if not steps:
                raise FileNotFoundError(f"{directory} holds no checkpoint")
            if step is not None and step not in steps:
                raise FileNotFoundError(f"{directory} has no checkpoint at step {step}; saved steps: {steps}")
            abstract = {"params": abstract_with_shardings(fns.abstract_params, self.p_shard)}
            restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
            for s in ([step] if step is not None else sorted(steps, reverse=True)):
                try:
                    # partial restore: the optimizer state stays on disk (no 3x parameter memory)
                    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
                        item=abstract, restore_args=restore_args, partial_restore=True))
                    restored = ckpt.manager.restore(s, args=args)
                    return restored.state["params"], int(s)
                except Exception as e:  # torn or corrupt: fall back, as the trainer does
                    if step is not None:
                        raise
                    log.warning("checkpoint at step %d in %s does not restore (%s: %s); trying an older one",
                                s, directory, type(e).__name__, str(e)[:300])
            raise FileNotFoundError(f"no checkpoint in {directory} restores")
        finally:
            ckpt.close()

    def _streams(self, cfg: Config):
        from hybrid_lm.data.pipeline import DataStreams

        key = (cfg.data.seq_len, cfg.data.eval_windows)
        if key not in self._data:
            self._data[key] = DataStreams(cfg)
        return self._data[key]

    def trained_eval(self, seq_len: int) -> dict | None:
        """The trainer's eval row at the restored step (same windows), if metrics.jsonl has it."""
        from hybrid_lm.train.metrics import read_metrics

        path = self.workdir / "metrics.jsonl"
        if seq_len != self.cfg.data.seq_len or not path.exists():
            return None
        rows = [r for r in read_metrics(path, "eval") if r["step"] == self.step]
        return rows[-1] if rows else None

    def evaluate(self, swaps=(), horizon: int | None = None, sinks: int = 0, *, seq_len: int | None = None,
                 eval_windows: int | None = None, attention_impl: str | None = None, record: bool = True) -> dict:
        """Loss (nats/token) and bits/byte of the swapped / constrained model; appends to eval.jsonl."""
        from hybrid_lm.data.corpus import bits_per_byte
        from hybrid_lm.model.registry import recorded_backends
        from hybrid_lm.train import sharding as shd
        from hybrid_lm.train.loop import put_batch
        from hybrid_lm.train.step import ModelFns, make_eval_step

        t0 = time.time()
        swaps = [parse_swap(s) if isinstance(s, str) else s for s in swaps]
        cfg = swapped_config(self.cfg, swaps, horizon, sinks, seq_len=seq_len, eval_windows=eval_windows,
                             attention_impl=attention_impl)
        model, data = cfg.model, cfg.data
        streams = self._streams(cfg)
        eb = streams.eval_batch
        # the trainer's batching (train/loop.py run_eval), so an unswapped eval reproduces its number
        nbs = self.n_batch_shards
        per = max(nbs, (min(cfg.train.global_batch, eb.shape[0]) // nbs) * nbs)
        n = (eb.shape[0] // per) * per
        if n == 0:
            raise SwapError(f"{eb.shape[0]} eval windows of {data.seq_len} tokens cannot fill one batch of {per} "
                            f"rows on {nbs} batch shards; use a shorter seq_len or more eval windows")
        fns = ModelFns(cfg)
        recorded_backends(clear=True)  # filled by the eval step's trace
        with jax.set_mesh(self.mesh):
            eval_fn = jax.jit(make_eval_step(fns), in_shardings=(self.p_shard, self.batch_shard),
                              out_shardings=shd.replicated(self.mesh))
            losses = [float(eval_fn(self.params, put_batch(eb[i:i + per], self.batch_shard)))
                      for i in range(0, n, per)]
        ce = float(np.mean(losses))
        row = {"kind": "swap_eval", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": self.step,
               "checkpoint_step": self.step, "run_id": self.cfg.run_id(),
               "swaps": [s.spec or s.to_dict() for s in swaps], "horizon": horizon,
               "sinks": sinks if horizon is not None else None,
               "seq_len": data.seq_len, "trained_seq_len": self.cfg.data.seq_len, "eval_windows": n,
               "loss": ce, "bpb": bits_per_byte(ce, streams.bytes_per_token),
               "layer_types": "".join(model.layer_types()), "mixers": describe(model),
               "trained_mixers": describe(self.cfg.model), "attention_impl": model.attention_impl,
               "attention_backends": recorded_backends(), "devices": int(self.mesh.devices.size), "wall_s": round(time.time() - t0, 3)}
        ref = self.trained_eval(data.seq_len)
        if ref is not None and ref.get("eval_windows", n) == n:
            row["trained_eval_loss"] = ref["loss"]
            row["delta_loss"] = ce - ref["loss"]
        if record and jax.process_index() == 0:
            with (self.workdir / "eval.jsonl").open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        return row


def evaluate(workdir: Path | str, swaps=(), horizon: int | None = None, sinks: int = 0, *,
             seq_len: int | None = None, step: int | None = None, eval_windows: int | None = None,
             attention_impl: str | None = None, record: bool = True) -> dict:
    """One evaluation of ``workdir``'s checkpoint (``step`` or the latest) under the given settings.
    The settings are checked before the checkpoint is restored."""
    swapped_config(load_run_config(workdir), swaps, horizon, sinks, seq_len=seq_len, eval_windows=eval_windows,
                   attention_impl=attention_impl)
    return SwapEvaluator(workdir, step=step).evaluate(swaps, horizon, sinks, seq_len=seq_len,
                                                      eval_windows=eval_windows, attention_impl=attention_impl,
                                                      record=record)


def read_eval_rows(workdir: Path | str) -> list[dict]:
    path = Path(workdir) / "eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


__all__ = ["Swap", "SwapError", "SwapEvaluator", "apply_swaps", "check_params_match", "evaluate",
           "parse_swap", "read_eval_rows", "swapped_config", "swapped_mixer"]

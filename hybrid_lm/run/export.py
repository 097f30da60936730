"""``hybrid-lm export``: a run's checkpoint as ``model.safetensors`` plus a ``config.json``.

    hybrid-lm export RUN_DIR[@STEP] [--format safetensors|hf] [--dtype fp32|bf16] [--out DIR] [--force]

``--format hf`` writes a folder transformers loads with ``AutoModelForCausalLM.from_pretrained``
(``hybrid_lm/run/hf.py``: transformers' names and config, the run's tokenizer files,
``generation_config.json``; the run, step and hybrid_lm's config under the ``hybrid_lm`` key of
config.json); layers transformers has no counterpart for are refused before anything is restored.
Default output: ``RUN_DIR/export/step_<N>-hf``. The rest of this docstring is the default format.

The parameters of checkpoint STEP (default: the newest that restores) are written under flat names
joined from their NNX state paths (``blocks.0.mixer.wq``, ``embed.table``, ``lm_head``), fp32 as
stored or cast to bf16. ``config.json`` is the run's ``config.json`` with an ``export`` entry: step,
run id, source directory, dtype, the hybrid_lm version, the parameters' fingerprint
(``run/checkpoint.py::params_fingerprint`` of the restored tree) and, per parameter, its shape,
dtype and logical axes. The default output is ``RUN_DIR/export/step_<N>/``. The directory is
written under a temporary name beside it and renamed when complete; an existing export is replaced
only with ``force``.

:func:`load_exported` reads an export back (nested parameter tree, config dict);
:func:`exported_model` builds the :class:`~hybrid_lm.model.transformer.HybridLM` from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from hybrid_lm.config import Config, config_from_dict
from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.run.param_names import flatten_params, param_name, unflatten_params  # noqa: F401  (re-exported)
from hybrid_lm.experiment import run_id
from hybrid_lm.optional import optional_import
from hybrid_lm.run.checkpoint import params_fingerprint
from hybrid_lm.run.directory import checkpoint_steps, config_path, load_run_config, read_run_config
from hybrid_lm.run import hf_check
from hybrid_lm.run.hf import HFCheckpoint, check_exportable, write_hf_folder
from hybrid_lm.run.restore import RestoredRun
from hybrid_lm.step import ModelFns
from hybrid_lm.validate import read_fields_only

FORMATS = ("safetensors", "hf")
DTYPES = {None: "float32", "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


# ----------------------------------------------------------------------------- names

def _version() -> str:
    try:
        return version("hybrid_lm")
    except PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------- export

def parse_run_spec(spec: str) -> tuple[Path, int | None]:
    """``(run dir, step or None for the newest)`` of ``RUN_DIR[@STEP]``; STEP a number or ``latest``."""
    text = str(spec)
    head, sep, tail = text.rpartition("@")
    if sep and head and not Path(text).exists():
        if tail.isdigit():
            return Path(head), int(tail)
        if tail == "latest":
            return Path(head), None
        raise ConfigError(f"{text}: @STEP must be a saved step number or 'latest', got {tail!r}")
    return Path(text), None


def _check_out(out: Path, force: bool) -> None:
    """Refuse an existing ``out`` unless ``force`` and it is an export (or an empty directory)."""
    if not out.exists():
        return
    if not force:
        raise WorkdirError(f"{out} already exists; pass --force (force=True) to replace it, or choose --out")
    if not out.is_dir():
        raise WorkdirError(f"{out} exists and is not a directory; --force replaces only an earlier export")
    if any(out.iterdir()):
        try:
            d = json.loads((out / CONFIG).read_text())
            is_export = "export" in d or "hybrid_lm" in d  # ours, or ours in transformers' format
        except (OSError, ValueError, TypeError):
            is_export = False
        if not is_export:
            raise WorkdirError(f"{out} is not an earlier export (no {CONFIG} with an 'export' or 'hybrid_lm' "
                               "entry); --force replaces only those, choose another --out")


def export_checkpoint(run_spec: str, out=None, fmt: str = "safetensors", dtype: str | None = None,
                      force: bool = False) -> Path:
    """Write checkpoint ``RUN_DIR[@STEP]`` to ``out`` (default ``RUN_DIR/export/step_<N>``) as ``fmt``
    with parameters in ``dtype`` (None / fp32: as stored; bf16); returns the directory.

    Raises :class:`ConfigError` for an unknown format or dtype or a bad @STEP, :class:`WorkdirError`
    for a path that is not a run directory, a step that was not saved or does not restore, or an
    existing ``out`` without ``force``. Everything is checked before the checkpoint is restored,
    except the default ``out`` of the newest step (known once restored)."""

    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r} is not supported; formats: {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"export dtype {dtype!r}: use fp32 (as stored) or bf16")
    run_dir, step = parse_run_spec(run_spec)
    if not run_dir.is_dir():
        raise WorkdirError(f"{run_spec}: no run directory {run_dir}")
    try:
        cfg = load_run_config(run_dir)
    except FileNotFoundError as e:
        raise WorkdirError(str(e)) from None
    if fmt == "hf":
        check_exportable(cfg.model)  # a layer transformers has no counterpart for: refused before the restore
    saved = checkpoint_steps(run_dir, missing_ok=True)
    if not saved:
        raise WorkdirError(f"{run_dir} holds no checkpoint: train the run first")
    if step is not None and step not in saved:
        raise WorkdirError(f"{run_dir} has no checkpoint at step {step}; saved steps: {saved}")
    out = None if out is None else Path(out)
    suffix = "-hf" if fmt == "hf" else ""
    if out is not None or step is not None:
        _check_out(out or run_dir / "export" / f"step_{step}{suffix}", force)
    if jax.process_count() > 1:
        raise ConfigError("hybrid-lm export runs in a single process (it gathers every parameter on the host)")
    optional_import("safetensors")
    from safetensors.numpy import save_file  # the [eval] extra

    try:
        run = RestoredRun(run_dir, step=step)
    except FileNotFoundError as e:
        raise WorkdirError(str(e)) from None
    out = out or run_dir / "export" / f"step_{run.step}{suffix}"
    _check_out(out, force)

    target = DTYPES[dtype]
    flat = {}
    for name, leaf in flatten_params(jax.device_get(run.params)).items():
        arr = np.asarray(leaf)
        if target == "bfloat16":
            arr = arr.astype(ml_dtypes.bfloat16)
        flat[name] = np.ascontiguousarray(arr)
    axes = _flat_axes(run.fns.axes)
    raw = read_run_config(config_path(run_dir))[0]
    raw.pop("export", None)
    meta = {"format": fmt, "weights": WEIGHTS, "step": run.step, "run_id": run_id(run.cfg),
            "source": str(run_dir.resolve()), "dtype": target, "hybrid_lm_version": _version(),
            "params_fingerprint": params_fingerprint(run.params), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "n_params": int(sum(a.size for a in flat.values())),
            "params": {name: {"shape": list(a.shape), "dtype": str(a.dtype), "axes": axes.get(name)}
                       for name, a in flat.items()}}

    if fmt == "hf":
        record = {k: v for k, v in meta.items() if k not in ("params", "weights")}
        record.update(model=dataclasses.asdict(run.cfg.model),
                      data={"tokenizer": run.cfg.data.tokenizer, "seq_len": run.cfg.data.seq_len})

        def write(tmp: Path) -> None:
            write_hf_folder(tmp, run.cfg.model, flat, tokenizer=run.cfg.data.tokenizer,
                            seq_len=run.cfg.data.seq_len, dtype=target, record=record)
    else:
        def write(tmp: Path) -> None:
            save_file(flat, str(tmp / WEIGHTS),
                      metadata={"format": "np", "hybrid_lm_step": str(run.step), "hybrid_lm_run_id": meta["run_id"]})
            (tmp / CONFIG).write_text(json.dumps({**raw, "export": meta}, indent=2))
    _write_dir(out, write)
    return out


def _write_dir(out: Path, write) -> None:
    """``write(tmp)`` into a temporary directory beside ``out``, then rename it to ``out`` (an existing
    ``out``, allowed by ``force``, is moved aside first and removed once the new one is in place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    old = out.with_name(f".{out.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        if out.exists():  # force, checked above: move the old export aside, then swap in the new one
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _flat_axes(axes_tree) -> dict:
    """``{name: [logical axis, ...]}`` (the axes tuples are leaves, not subtrees)."""
    leaves = jax.tree_util.tree_leaves_with_path(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
    return {param_name(path): list(a) for path, a in leaves}


# ----------------------------------------------------------------------------- read back

def load_exported(path) -> tuple[dict, dict]:
    """``(params, config)`` of an export: the nested parameter tree (numpy arrays, in the exported
    dtype; the layout of ``ModelFns.abstract_params``) and the config dict (the run's config.json
    plus ``export``). ``path``: the export directory or its ``model.safetensors``."""
    path = Path(path)
    directory = path.parent if path.is_file() else path
    weights, config = directory / WEIGHTS, directory / CONFIG
    for f in (weights, config):
        if not f.is_file():
            raise WorkdirError(f"{directory} is not an export: no {f.name}")
    optional_import("safetensors")
    from safetensors.numpy import load_file  # the [eval] extra

    cfg = json.loads(config.read_text())
    if "export" not in cfg:
        raise WorkdirError(f"{config} has no 'export' entry: not written by hybrid-lm export")
    return unflatten_params(load_file(str(weights))), cfg


def exported_model(path):
    """``(HybridLM, Config)`` of an export: its config (in the current schema) and parameters (cast
    to the model's dtypes; bf16 exports come back rounded). Shapes are checked."""

    params, d = load_exported(path)
    cfg = read_fields_only(config_from_dict({k: v for k, v in d.items() if k != "export"}))
    fns = ModelFns(cfg)
    want = flatten_params(fns.abstract_params)
    got = flatten_params(params)
    if set(want) != set(got) or any(tuple(got[k].shape) != tuple(want[k].shape) for k in want):
        diff = sorted(set(want) ^ set(got)) or [k for k in want if tuple(got[k].shape) != tuple(want[k].shape)]
        raise ConfigError(f"{path}: the exported parameters do not fit the exported config ({', '.join(diff[:5])})")
    cast = jax.tree.map(lambda a, s: jnp.asarray(a, s.dtype), params, fns.abstract_params)
    return fns.model(cast), cfg


# ----------------------------------------------------------------------------- command line

def cmd_export(args) -> int:
    if args.check:
        if args.fmt != "hf":
            raise ConfigError("--check compares logits through transformers: it applies to --format hf")
        hf_check.require()  # before anything is restored or written
    path = export_checkpoint(args.run, out=args.out, fmt=args.fmt, dtype=args.dtype, force=args.force)
    d = json.loads((path / CONFIG).read_text())
    meta = d.get("export") or d["hybrid_lm"]
    if args.json:
        print(json.dumps({k: v for k, v in meta.items() if k not in ("params", "model", "data")}
                         | {"out": str(path), "format": args.fmt}, indent=2))
    elif args.fmt == "hf":
        print(f"exported step {meta['step']} of {meta['source']} as transformers {d['architectures'][0]} "
              f"({meta['n_params']:,} parameters, {meta['dtype']}) to {path}")
    else:
        print(f"exported step {meta['step']} of {meta['source']} ({len(meta['params'])} tensors, "
              f"{meta['n_params']:,} parameters, {meta['dtype']}) to {path}")
    return _check(path, args) if args.check else 0


def _check(path: Path, args) -> int:
    """``--check``: the exported folder's logits through transformers against hybrid_lm's (``run/hf_check.py``)."""
    ck = HFCheckpoint(path)
    model = ck.model_config()
    params = ck.read_params(ModelFns(Config(model=model)).abstract_params)  # the weights as exported
    ok, line = hf_check.check_export(
        path, model, params, load_tokenizer(ck.tokenizer_spec()), ck.config().data.seq_len,
        prompt=hf_check.DEFAULT_PROMPT if args.check_prompt is None else args.check_prompt,
        bound=hf_check.DEFAULT_BOUND if args.check_bound is None else args.check_bound)
    print(line)
    return 0 if ok else 1


def add_export_command(sub) -> None:
    """Add ``export`` to the ``hybrid-lm`` subparsers."""
    p = sub.add_parser(
        "export", help="write a run's checkpoint as model.safetensors + config.json (ours, or transformers')",
        description="Write the parameters of RUN_DIR's checkpoint STEP (default: the newest that restores) to "
                    "DIR/model.safetensors under flat names from their NNX paths (blocks.0.mixer.wq, ...), and "
                    "DIR/config.json: the run's config.json plus an 'export' entry (step, run id, dtype, version, "
                    "per-parameter shape and logical axes). --format hf: a folder transformers loads with "
                    "AutoModelForCausalLM.from_pretrained (Llama, Ministral, Qwen3 or SmolLM3; the run's tokenizer "
                    "files; docs/INTEROP.md); layers transformers has no counterpart for are refused. Written to a "
                    "temporary directory, then renamed.",
        epilog="examples: hybrid-lm export runs/quickstart@200 --dtype bf16;  "
               "hybrid-lm export runs/quickstart --format hf --out /tmp/quickstart-hf")
    p.add_argument("run", metavar="RUN_DIR[@STEP]", help="run directory, optionally @STEP (a saved step or 'latest')")
    p.add_argument("--format", dest="fmt", default="safetensors",
                   help="safetensors (hybrid_lm's names, the default) or hf (a transformers model folder)")
    p.add_argument("--dtype", default=None, help="fp32 (as stored, the default) or bf16")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default RUN_DIR/export/step_<N>, with --format hf step_<N>-hf)")
    p.add_argument("--force", action="store_true", help="replace an earlier export at DIR")
    p.add_argument("--json", action="store_true", help="print the export metadata as JSON")
    p.add_argument("--check", action="store_true",
                   help="with --format hf: load the folder with transformers and compare the logits of a prompt with "
                        "hybrid_lm's (the relative error printed; exit 1 past --check-bound). Needs torch and "
                        "transformers")
    p.add_argument("--check-prompt", default=None, metavar="TEXT", help="the prompt of --check (default: a sentence)")
    p.add_argument("--check-bound", type=float, default=None, metavar="REL",
                   help="the largest relative error --check accepts (default 1e-4)")
    p.set_defaults(fn=cmd_export)


__all__ = ["DTYPES", "FORMATS", "add_export_command", "export_checkpoint", "exported_model", "flatten_params",
           "load_exported", "parse_run_spec", "unflatten_params"]

"""docs/BENCHMARKS.md and the README's table, generated from the result files.

    python experiments/report.py                 # writes docs/BENCHMARKS.md and README.md's results block
    python experiments/report.py --print         # also prints the README table

Reads ``experiments/results/<device>/<bench>.json`` (written by the ``bench_*.py`` scripts through
``experiments/harness.py``) and writes, per device, one table per benchmark with the command that produced it,
the device, the date and commit, and every ratio against the anchor measured in the same run. A benchmark
without a result file says so and names its command. The README's table (between ``<!-- results:begin -->``
and ``<!-- results:end -->``) is the S5 train step per architecture with its anchor, MoBA's and SSA's step
ratios and decoding at 128K, all from one device (``--readme-device``, default: the GPU whose train result is
newest). No number here is typed by hand: each comes from a JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent
ROOT = EXPERIMENTS.parent
RESULTS = EXPERIMENTS / "results"
MAX_LINES = 400  # docs/BENCHMARKS.md
MAX_FILES = 40  # result files kept
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
README_CMD = "bash experiments/gpu.sh readme"

# bench -> (title, the question it answers, the command that produces it)
BENCHES = {
    "train": ("Train step", "tokens/s, MFU, peak memory and compile time per architecture, against a plain-JAX GPT",
              README_CMD),
    "decode": ("Decoding", "tokens/s of cached decoding per mixer layer and per model, against full attention",
               "bash experiments/gpu.sh bench decode"),
    "attention": ("Attention kernels against cuDNN", "our windowed and block-sparse kernels against cuDNN",
                  "bash experiments/gpu.sh bench attention"),
    "sparse": ("Sparse selection and kernels", "MoBA / SSA block selection and the union and gather kernels at S5's "
               "shapes, against cuDNN full causal attention", "bash experiments/gpu.sh bench sparse"),
    "mixers": ("Mixer layers", "one mixer layer's forward and backward per kind, against a full-attention layer",
               "bash experiments/gpu.sh bench mixers"),
    "kernels": ("Loss and conv kernels", "the loss's softmax pass and the short conv's backward, kernel against XLA",
                "bash experiments/gpu.sh bench kernels"),
    "eval": ("Evaluation suite", "seconds per task of `hybrid-lm eval` on one checkpoint",
             "bash experiments/gpu.sh bench eval"),
    "data": ("Data path", "`data prepare` against `tokenizers`, and the loader against the fastest train step",
             "bash experiments/gpu.sh bench data"),
    "determinism": ("Deterministic GPU training: its cost", "tokens/s of `HYBRID_LM_DETERMINISTIC=1` against XLA's "
                    "default GPU ops on three S1 models, and whether two runs of each are bitwise equal",
                    "bash experiments/determinism.sh"),
}
ARCH_LABEL = {"full": "full attention", "swa": "SWA-128 hybrid", "sa": "SA-128 hybrid", "sa_swa": "SA+SWA-128 hybrid",
              "lightning": "Lightning hybrid", "mamba2": "Mamba-2 hybrid", "gdn": "GDN hybrid", "moba": "MoBA hybrid",
              "ssa": "SSA", "ssa_sparse": "SSA (sparse stream)", "ssa_full": "SSA (full stream)",
              "anchor_gpt": "**anchor GPT**"}


# ----------------------------------------------------------------------------- formatting

def f(x, spec=".1f", empty="—"):
    return empty if x is None else format(x, spec)


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


def table(headers, rows) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + [
        "| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def label(arch: str, model: bool = True) -> str:
    """A model's name (``model``) or a layer's (the mixer alone: no "hybrid")."""
    base, _, rest = arch.partition("@")
    name = ARCH_LABEL.get(base, base)
    return (name if model else name.removesuffix(" hybrid")) + (f" @{rest}" if rest else "")


def when(doc) -> str:
    d = (doc.get("date") or "")[:16].replace("T", " ")
    return f"{d} UTC" if d else "unknown date"


def provenance(doc) -> list[str]:
    git = f", commit {doc['git']}" if doc.get("git") else ""
    dev = doc.get("device_kind", doc.get("device"))
    n = doc.get("devices", 1)
    return [f"`{doc.get('command', '?')}` on {dev}{f' x{n}' if n and n > 1 else ''}, {when(doc)}, "
            f"jax {doc.get('jax', '?')}{git}" + (f", {doc['wall_s']:.0f} s." if doc.get("wall_s") is not None else ".")
            + (f" Recovered from {doc['recovered_from']}." if doc.get("recovered_from") else ""), ""]


def failed(rows) -> list[str]:
    bad = [r for r in rows if r.get("status", "ok") != "ok"]
    if not bad:
        return []
    return ["", "Not measured in this run: " + "; ".join(
        f"{r.get('scale', '')} {r.get('arch', r.get('impl', r.get('task', '?')))} {r.get('status')}".strip()
        + (f" ({r['error'][:80]})" if r.get("error") else "") for r in bad) + "."]


# ----------------------------------------------------------------------------- one table per benchmark

def _train_rows(doc):
    anchor = doc.get("anchor") or {}
    ok = [r for r in doc["rows"] if r.get("status") == "ok"]
    scales = sorted({r["scale"] for r in ok})
    full = {r["scale"]: r for r in ok if r["arch"].partition("@")[0] == "full"}
    out = []
    for r in ([anchor] if anchor.get("status") == "ok" else []) + ok:
        base = full.get(r.get("scale"))
        per_token = None if r is anchor or not base else base["tokens_per_sec"] / r["tokens_per_sec"]
        mfu_ratio = 1.0 if r is anchor else (r["mfu"] / anchor["mfu"] if anchor.get("status") == "ok" else None)
        out.append(([r["scale"].upper() if r is not anchor else "—"] if len(scales) > 1 else [])
                   + [label(r["arch"]), r["batch"], f(r["ms_per_step"]), f(r["tokens_per_sec"] / 1e3, ".1f") + "K",
                      pct(r["mfu"]), f(mfu_ratio, ".2f"), f(per_token, ".2f"),
                      f((r.get("peak_bytes") or 0) / 2 ** 30), f(r.get("compile_s"))])
    heads = (["scale"] if len(scales) > 1 else []) + ["arch", "B", "ms/step", "tokens/s", "MFU", "MFU / anchor",
                                                      "time per token / full", "peak GiB", "compile s"]
    return heads, out


def train_note(doc) -> str:
    seq = sorted({r.get("seq_len") for r in doc["rows"] if r.get("seq_len")})
    anchor = doc.get("anchor") or {}
    rule = " (the micro-batch rule on this device)" if doc.get("batch") == "rule" else ""
    gpt = (f"a plain-JAX GPT of {anchor['non_embedding'] / 1e6:.0f}M non-embedding parameters at B = "
           f"{anchor['batch']} (whole logits, the attention of `jax.nn.dot_product_attention`)"
           if anchor.get("non_embedding") else "a plain-JAX GPT")
    peak = f((doc.get("peak_flops") or 0) / 1e12, ".0f")
    return (f"T = {', '.join(map(str, seq))}, random tokens, B sequences per step{rule}; the steps compiled together, "
            f"then timed one at a time; MFU against {peak} TF/s per device; the anchor is {gpt}, measured in the same "
            "run.")


def render_train(doc) -> list[str]:
    heads, rows = _train_rows(doc)
    return [train_note(doc), ""] + table(heads, rows) + failed(doc["rows"])


def render_decode(doc) -> list[str]:
    out = []
    for level, what in (("layer", "one mixer layer's decode step"), ("model", "whole models' decode step")):
        rows = [r for r in doc["rows"] if r["level"] == level]
        if not rows:
            continue
        ctxs = sorted({r["context"] for r in rows})
        archs = list(dict.fromkeys(r["arch"] for r in rows))
        cell = {(r["arch"], r["context"]): r for r in rows}

        def c(a, C):
            r = cell.get((a, C))
            if r is None:
                return ""
            if r.get("status") != "ok":
                return r.get("status", "?")
            return f"{r['tokens_per_sec'] / 1e3:.1f}K ({f(r.get('vs_full'), '.2f')}x)"
        r0 = rows[0]
        out += [f"**{level}**: {what}, tokens/s at batch {r0['batch']} (x full attention at the same context), "
                f"scale {r0['scale'].upper()}, {r0['dtype']}.", ""]
        out += table(["arch"] + [f"{C // 1024}K" if C >= 1024 else str(C) for C in ctxs],
                     [[label(a, level == "model")] + [c(a, C) for C in ctxs] for a in archs]) + [""]
    return out


def render_attention(doc) -> list[str]:
    out = []
    for tab, what in (("windowed", "windowed attention, ms forward+backward (x the anchor, cuDNN's sliding window)"),
                      ("moba", "block-sparse attention, ms forward+backward (x the anchor, cuDNN full causal)")):
        rows = [r for r in doc["rows"] if r["table"] == tab]
        if not rows:
            continue
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        keys = list(dict.fromkeys((r["T"], r["B"], r.get("window", r.get("block"))) for r in rows))
        cell = {(r["T"], r["B"], r.get("window", r.get("block")), r["impl"]): r for r in rows}

        def c(k, impl):
            r = cell.get((*k, impl))
            if r is None:
                return ""
            if r.get("fwd_bwd_ms") is None:
                return "failed"
            return f"{r['fwd_bwd_ms']:.2f}" + ("" if r.get("anchor") else f" ({f(r.get('fwd_bwd_vs_anchor'), '.2f')}x)")
        r0 = rows[0]
        extra = f", top-{r0['top_k']} of {-(-r0['T'] // r0['block'])} blocks" if tab == "moba" else ""
        out += [f"**{tab}**: {what}; bf16, H = {r0['H']}, D = {r0['D']}{extra}.", ""]
        out += table(["T", "B", "window" if tab == "windowed" else "block"] + impls,
                     [[*k] + [c(k, i) for i in impls] for k in keys]) + [""]
    return out


def render_sparse(doc) -> list[str]:
    rows = doc["rows"]
    r0 = rows[0]
    out = [f"B = {r0['B']}, H = {r0['H']} on K = {r0['K']}, D = {r0['D']}, block {r0['block']}, top-{r0['top_k']}, "
           f"the {r0['gate']} gate, per-token selection, bf16; ms (x the anchor, cuDNN full causal attention).", ""]
    return out + table(["T", "part", "impl", "forward", "forward+backward"], [
        [r["T"], r["part"], r["impl"], f"{f(r['fwd_ms'], '.3f')} ({f(r.get('fwd_vs_anchor'), '.2f')}x)",
         "—" if r.get("fwd_bwd_ms") is None else f"{r['fwd_bwd_ms']:.3f} ({f(r.get('fwd_bwd_vs_anchor'), '.2f')}x)"]
        for r in rows])


def render_mixers(doc) -> list[str]:
    rows = doc["rows"]
    r0 = rows[0]
    out = [f"Scale {r0['scale'].upper()} (d_model {r0['d_model']}), B = {r0['B']}, T = {r0['T']}, {r0['dtype']}; "
           "ms (x the full-attention layer).", ""]
    return out + table(["arch", "mixer", "forward", "forward+backward"], [
        [label(r["arch"], False), r["mixer"], f"{f(r['fwd_ms'], '.3f')} ({f(r.get('fwd_vs_full'), '.2f')}x)",
         f"{f(r['fwd_bwd_ms'], '.3f')} ({f(r.get('fwd_bwd_vs_full'), '.2f')}x)"] for r in rows])


def render_kernels(doc) -> list[str]:
    return ["ms (x XLA's time for the same computation); GB/s of the bytes a one-pass kernel moves.", ""] + table(
        ["part", "shape", "impl", "ms", "GB/s", "x XLA"],
        [[r["part"], "x".join(map(str, r["shape"])), r["impl"], f(r["ms"], ".3f"), f(r.get("gb_per_s"), ".0f"),
          f(r.get("vs_anchor"), ".2f")] for r in doc["rows"]])


def render_eval(doc) -> list[str]:
    train = doc.get("train")
    what = (f"a run trained here ({train['steps']} steps{', ' + train['scale'].upper() if train.get('scale') else ''})"
            if train else "a given run")
    out = [f"`hybrid-lm eval` on the latest checkpoint (step {doc.get('checkpoint_step')}) of {what}, "
           f"task settings {'`' + ' '.join(doc['eval_args']) + '`' if doc.get('eval_args') else 'the tasks defaults (the papers)'}; `all` is the whole command (restore, compiles, "
           "plots).", ""]
    return out + table(["task", "seconds"], [[r["task"], f(r["wall_s"])] for r in doc["rows"]])


def render_data(doc) -> list[str]:
    out = [f"{doc.get('cpu_count')} CPU cores, a {doc.get('corpus_mb')} MB corpus.", ""]
    out += table(["prepare workers", "tokens/s", "tokenizers alone, tokens/s", "x tokenizers"],
                 [[r["workers"], f(r["tokens_per_sec"], ",.0f"), f(r["anchor_tokens_per_sec"], ",.0f"),
                   f(r["vs_anchor"], ".2f")] for r in doc["rows"] if r["part"] == "prepare"])
    consumer = (doc.get("anchor") or {}).get("loader", "the fastest consumer")
    out += ["", f"Loader against {consumer}:", ""]
    out += table(["seq_len", "batch", "document ids", "tokens/s", "x consumer"],
                 [[r["seq_len"], r["batch"], r["document_mask"], f(r["tokens_per_sec"], ",.0f"),
                   f(r["vs_anchor"], ".2f")] for r in doc["rows"] if r["part"] == "loader"])
    return out


def render_determinism(doc) -> list[str]:
    out = [f"S1, T = 4096, 32 x 4096 tokens per step, {doc['steps']} steps, two runs per model and mode; tokens/s "
           f"the mean of the two runs' medians over steps >= {doc['from_step']}; the anchor is the same model with "
           "XLA's default GPU ops, trained in the same run of the script.", ""]
    return out + table(["model", "mode", "bitwise equal", "first differing step", "tokens/s", "x default",
                        "attention"],
                       [[r["model"], r["mode"], "yes" if r["bitwise_equal"] else "no",
                         r["first_difference"] if r["first_difference"] is not None else "—",
                         f(r["tokens_per_sec"], ",.0f"), f(r["vs_default"], ".3f"),
                         ", ".join(f"{k}: {v}" for k, v in (r["attention"] or {}).items())] for r in doc["rows"]])


def determinism_result(root: Path, command: str) -> dict:
    """``experiments/determinism.sh``'s runs under ``root`` as a result file (experiments/determinism.py's
    rows; the device and packages from the first run's ``provenance.json``, the date from its metrics file)."""
    import datetime

    sys.path.insert(0, str(EXPERIMENTS))
    from determinism import FROM_STEP, summary

    rows = summary(root)
    first = root / f"{rows[0]['model']}-{rows[0]['mode']}1"
    prov = json.loads((first / "provenance.json").read_text())
    when_run = datetime.datetime.fromtimestamp((first / "metrics.jsonl").stat().st_mtime, datetime.timezone.utc)
    git = os.environ.get("HYBRID_LM_COMMIT") or prov.get("git", {}).get("sha", "")  # a copied checkout's .git can lag
    return {"bench": "determinism", "command": command, "device_kind": prov.get("device_kind"), "devices": 1,
            "jax": prov.get("packages", {}).get("jax"), "date": when_run.strftime("%Y-%m-%dT%H:%M:%S"),
            "git": git[:7], "wall_s": None, "steps": rows[0]["steps"], "from_step": FROM_STEP,
            "anchor": {"mode": "default"}, "rows": rows}


RENDER = {"determinism": render_determinism, "train": render_train, "decode": render_decode, "attention": render_attention, "sparse": render_sparse,
          "mixers": render_mixers, "kernels": render_kernels, "eval": render_eval, "data": render_data}


# ----------------------------------------------------------------------------- the files

def load(results: Path) -> dict:
    """``{device: {bench: doc}}`` of every result file."""
    out: dict = {}
    for path in sorted(results.glob("*/*.json")):
        doc = json.loads(path.read_text())
        out.setdefault(path.parent.name, {})[path.stem] = doc
    return out


def device_order(devices) -> list[str]:
    return sorted(devices, key=lambda d: (d == "cpu", d))


def benchmarks_md(data: dict, results: Path) -> str:
    rel = results.relative_to(ROOT) if results.is_relative_to(ROOT) else results
    lines = ["# Benchmarks", "",
             "Current numbers only. Generated by `python experiments/report.py` from "
             f"`{rel}/<device>/<bench>.json` (one file per benchmark and device, overwritten by a rerun): do not "
             "edit by hand. Each table names the command that produced it, the device, the date and the commit; "
             "every ratio divides by the anchor measured in the same run.", "",
             f"On one GPU: `{README_CMD}` (the README's table, under 10 minutes), `bash experiments/gpu.sh bench "
             "[NAMES]` (the others), `bash experiments/gpu.sh test` (the GPU correctness tests, `tests/gpu`). "
             "Each script runs alone too (`python experiments/bench_<name>.py --help`).", ""]
    if not data:
        lines += ["No results yet. Not measured yet on any device:", ""]
        lines += [f"- {title}: run `{cmd}`" for title, _, cmd in BENCHES.values()]
        return "\n".join(lines) + "\n"
    for dev in device_order(data):
        docs = data[dev]
        kind = next(iter(docs.values())).get("device_kind", dev)
        lines += [f"## {dev.upper()} ({kind})", ""]
        missing = []
        for bench, (title, question, cmd) in BENCHES.items():
            doc = docs.get(bench)
            if doc is None:
                if dev != "cpu" and bench != "determinism":  # no benchmarks: shown once they ran
                    missing.append(f"{title} (`{cmd}`)")
                continue
            lines += [f"### {title}", "", f"{question[0].upper()}{question[1:]}.", ""] + provenance(doc)
            lines += RENDER[bench](doc) + [""]
        if missing:  # one line, not a heading per missing table
            lines += ["Not measured yet on this device: " + "; ".join(missing) + ".", ""]
    return "\n".join(lines).rstrip() + "\n"


def readme_device(data: dict, name: str | None) -> str | None:
    if name:
        return name if name in data else None
    gpus = [(d["train"].get("date", ""), dev) for dev, d in data.items() if dev != "cpu" and "train" in d]
    return max(gpus)[1] if gpus else None


def readme_table(data: dict, name: str | None = None) -> str:
    dev = readme_device(data, name)
    if dev is None:
        return (f"Not measured yet: run `{README_CMD}` on one GPU, then `python experiments/report.py` "
                "(docs/BENCHMARKS.md).")
    docs = data[dev]
    train = docs["train"]
    heads, rows = _train_rows(train)
    scales = ", ".join(sorted({r["scale"].upper() for r in train["rows"]}))
    lines = [f"{scales} train step on one {train.get('device_kind', dev)} ({when(train)}, commit {train.get('git')}). "
             + train_note(train), ""] + table(heads, rows) + failed(train["rows"])
    ok = {r["arch"].partition("@")[0]: r for r in train["rows"] if r.get("status") == "ok"}
    if "full" in ok:
        ratios = [f"{label(a)} {ok['full']['tokens_per_sec'] / ok[a]['tokens_per_sec']:.2f}x" for a in ("moba", "ssa")
                  if a in ok]
        if ratios:
            lines += ["", "Step time per token against full attention: " + ", ".join(ratios) + "."]
    dec = docs.get("decode")
    rows = [r for r in (dec or {}).get("rows", []) if r["level"] == "model" and r["context"] == 131072]
    if rows:
        r0 = rows[0]
        lines += ["", f"Decoding at 128K tokens of context, {r0['scale'].upper()} models, batch {r0['batch']} "
                      f"({when(dec)}):", ""]
        lines += table(["model", "tokens/s", "x full attention"],
                       [[label(r["arch"]), f(r.get("tokens_per_sec"), ",.0f") if r.get("status") == "ok"
                         else r.get("status"), f(r.get("vs_full"), ".2f")] for r in rows])
    else:
        lines += ["", f"Decoding at 128K: not measured yet on this device: run `{README_CMD}`."]
    lines += ["", "Generated by `python experiments/report.py` from "
                  f"`experiments/results/{dev}/`; every benchmark: `docs/BENCHMARKS.md`."]
    return "\n".join(lines)


def write_readme_block(readme: Path, block: str) -> bool:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"{readme}: no {BEGIN} ... {END} block: left unchanged", file=sys.stderr)
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(RESULTS), help="the results folder (<device>/<bench>.json)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"), help="README with the results block ('none': skip)")
    ap.add_argument("--readme-device", default=None, help="the device of the README's table (default: newest GPU)")
    ap.add_argument("--print", action="store_true", help="print the README table")
    ap.add_argument("--determinism", default=None, metavar="ROOT",
                    help="first write determinism.sh's runs under ROOT as <results>/<device>/determinism.json")
    args = ap.parse_args(argv)
    results = Path(args.results)
    made = []
    if args.determinism:
        made.append(determinism_result(Path(args.determinism), "bash experiments/determinism.sh"))
    for doc in made:
        dev = "h200" if "H200" in doc["device_kind"] else "h100" if "H100" in doc["device_kind"] else "gpu"
        (results / dev).mkdir(parents=True, exist_ok=True)
        (results / dev / f"{doc['bench']}.json").write_text(json.dumps(doc, indent=1) + "\n")
    files = sorted(results.glob("*/*.json")) if results.exists() else []
    if len(files) > MAX_FILES:
        raise SystemExit(f"{results}: {len(files)} result files, more than {MAX_FILES}: delete the stale ones")
    data = load(results) if files else {}
    md = benchmarks_md(data, results.resolve())
    n = md.count("\n")
    if n > MAX_LINES:
        raise SystemExit(f"{args.out} would have {n} lines, more than {MAX_LINES}: measure fewer variants")
    Path(args.out).write_text(md)
    print(f"wrote {args.out} ({n} lines, {len(files)} result files)")
    block = readme_table(data, args.readme_device)
    if args.readme != "none" and write_readme_block(Path(args.readme), block):
        print(f"wrote the results block of {args.readme}")
    if args.print:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

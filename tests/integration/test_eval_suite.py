"""``hybrid-lm eval RUN --tasks ... --steps ...`` and ``hybrid-lm eval-report``: every checkpoint, rows
with the common fields, superseded per (task, eval config, step), ``--data STORE``, plots, bad input."""

import json

import numpy as np
import pytest

from hybrid_lm.cli import main

LONGPPL = ["--trunc-len", "8", "--window", "8", "--docs", "2"]


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """A tiny run with checkpoints at steps 5 and 10 (this module's own copy: its tests write into it)."""
    return tiny_run(10)


@pytest.fixture(scope="module")
def long_store(tmp_path_factory):
    """A byte-level store whose val split holds documents of 60-200 bytes (and two short ones)."""
    from hybrid_lm.data.prepare import PrepareSettings, prepare
    from hybrid_lm.data.sources import SourceSpec

    d = tmp_path_factory.mktemp("long_docs")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "report", "section", "figure", "table"]
    with (d / "docs.jsonl").open("w") as fh:
        for i in range(40):
            n = 4 if i % 10 == 9 and i < 20 else int(rng.integers(12, 40))
            fh.write(json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n")
    prepare(SourceSpec("text", paths=(str(d / "docs.jsonl"),)), d / "store", PrepareSettings(val_every=2),
            progress=False)
    return d / "store"


def _eval(capsys, *args):
    rc = main(["eval", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_loss_and_longppl_over_every_checkpoint(capsys, run_dir):
    rc, out, _ = _eval(capsys, run_dir, "--tasks", "loss,longppl", "--steps", "all", *LONGPPL)
    assert rc == 0, out
    assert "step       5" in out and "step      10" in out and "LongPPL" in out
    from hybrid_lm.eval.suite import current_rows
    rows = current_rows(run_dir)
    by = {(r["task"], r["checkpoint_step"]): r for r in rows if "eval_key" in r}
    assert set(by) == {("loss", 5), ("loss", 10), ("longppl", 5), ("longppl", 10)}
    for r in by.values():
        assert r["tokens_seen"] == r["checkpoint_step"] * 4 * 32
        assert r["eval_config"]["swaps"] == [] and len(r["eval_key"]) == 12
        assert r["attention_backends"], r
    assert 0 < by[("loss", 10)]["bpb"] < by[("loss", 5)]["bpb"] < 9
    assert (run_dir / "eval" / "loss.png").stat().st_size > 0
    assert (run_dir / "eval" / "longppl.png").stat().st_size > 0

    # the same request again supersedes, a swapped one is another eval config
    n_before = len(current_rows(run_dir))
    assert _eval(capsys, run_dir, "--tasks", "loss", "--steps", "10")[0] == 0
    assert len(current_rows(run_dir)) == n_before
    assert _eval(capsys, run_dir, "--tasks", "loss", "--swap", "efficient=swa:4", "--horizon", "4")[0] == 0
    rows = [r for r in current_rows(run_dir) if r.get("task") == "loss"]
    assert len(rows) == n_before - 2 + 1 and len({r["eval_key"] for r in rows}) == 2
    swapped = next(r for r in rows if r["eval_config"]["horizon"] == 4)
    assert swapped["swaps"] == ["efficient=swa:4"] and swapped["attention_backends"]


def test_every_task_through_the_cli_with_values_in_range(capsys, run_dir):
    """probe, heads, influence and ruler on both checkpoints (lm_eval: tests/test_lm_eval.py)."""
    rc, out, err = _eval(capsys, run_dir, "--tasks", "probe,heads,influence,ruler", "--steps", "all",
                         "--seq-len", "512", "--samples", "40", "--allow-longer", "--ruler-tasks", "niah_single",
                         "--ruler-lengths", "1K", "--probe-prompt", "exact")
    assert rc == 0, err
    from hybrid_lm.eval.suite import current_rows, headline
    rows = {(r["task"], r["checkpoint_step"]): r for r in current_rows(run_dir)
            if r.get("eval_config", {}).get("seq_len") == 512}
    assert set(rows) == {(t, s) for t in ("probe", "heads", "influence", "ruler/niah_single") for s in (5, 10)}
    for r in rows.values():
        assert r["tokens_seen"] == 128 * r["checkpoint_step"] and r["attention_backends"]
    for s in (5, 10):
        assert 0 <= headline(rows[("probe", s)]) <= 1 and len(rows[("probe", s)]["accuracy"]) == 2
        assert rows[("probe", s)]["eval_config"]["prompt"] == "exact" and rows[("heads", s)]["seq_len"] == 512
        assert 0 <= headline(rows[("heads", s)]) <= 1
        assert all(0 <= e <= 1 + 1e-6 for h in rows[("heads", s)]["entropy"] for e in h)
        g = np.asarray(rows[("influence", s)]["g"])
        assert g.shape == (512,) and np.all(np.isfinite(g)) and np.all(g >= 0) and g.max() > 0
        assert rows[("influence", s)]["inputs"] == "documents"
        assert 0 <= rows[("ruler/niah_single", s)]["exact_match"] <= 1
    assert rows[("heads", 10)]["d_qk"][0][0] == 0 and rows[("heads", 5)]["d_qk"][0][0] > 0  # vs the last
    for png in ("probe_heatmap.png", "heads_entropy_dqk.png", "influence.png", "ruler.png"):
        assert (run_dir / "eval" / png).stat().st_size > 0, png


def test_data_store_gives_loss_on_its_windows_and_longppl_on_its_documents(capsys, run_dir, long_store):
    rc, out, _ = _eval(capsys, run_dir, "--tasks", "loss,longppl", "--data", long_store, "--eval-windows", "2",
                       *LONGPPL, "--json")
    assert rc == 0
    rows = json.loads(out)
    loss, lp = rows
    assert loss["data"] == str(long_store) and "delta_loss" not in loss and loss["eval_windows"] == 2
    assert lp["documents"] == "store val documents" and lp["docs"] == 2 and lp["length"] == 33
    base = _eval(capsys, run_dir, "--tasks", "loss", "--no-record", "--json")[1]
    assert json.loads(base)[0]["loss"] != loss["loss"]  # another text than the run's val windows

    from hybrid_lm.data.store import TokenStore
    from hybrid_lm.eval.longppl import store_documents
    docs = store_documents(long_store, 33, 50, TokenStore(long_store).tokenizer["fingerprint"])
    val = TokenStore(long_store).split("val")
    assert len(docs) == int((val.doc_lengths >= 33).sum()) < val.n_docs  # the short documents are left out
    assert docs.shape[1] == 33 and np.array_equal(docs[0], val.read(int(val.doc_starts[
        int(np.flatnonzero(val.doc_lengths >= 33)[0])]), 33))


def test_eval_report_overlays_runs(capsys, run_dir, tmp_path):
    assert _eval(capsys, run_dir, "--tasks", "loss", "--steps", "all")[0] == 0
    rc = main(["eval-report", str(run_dir), "--out", str(tmp_path / "rep"), "--tasks", "loss"])
    out = capsys.readouterr().out
    assert rc == 0 and "loss" in out and "2 checkpoints" in out
    pngs = list((tmp_path / "rep").glob("loss_*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)
    assert main(["eval-report", str(run_dir), "--out", str(tmp_path / "rep"), "--tasks", "lm_eval"]) == 0
    out = capsys.readouterr().out
    assert "nothing to plot in 1 run dir: eval.jsonl holds" in out and "none of --tasks lm_eval" in out
    assert "`hybrid-lm eval RUN_DIR --tasks lm_eval --steps all`" in out


def test_eval_report_on_trainer_evals_only_says_what_it_found(capsys, tmp_path):
    """A sweep root whose runs hold only the trainer's periodic evals (metrics.jsonl, no eval.jsonl):
    the report counts them and names the command that writes eval-suite results."""
    jobs = [{"name": f"t1-full-dn{b}-seed0-x", "kind": "branch"} for b in (1, 2)]
    (tmp_path / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    for j in jobs:
        d = tmp_path / j["name"]
        d.mkdir()
        rows = [{"kind": k, "step": s, "loss": 2.0} for s in (5, 10) for k in ("train", "eval")]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["eval-report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("nothing to plot in 2 run dirs: no eval-suite results (no eval.jsonl rows); metrics.jsonl holds 4 "
            "trainer eval rows") in out, out
    assert "`hybrid-lm eval RUN_DIR --tasks loss --steps all` for each run" in out


def _run_dir(path, rows=None):
    """A run directory with a trainer row and, unless ``rows`` is None, an eval.jsonl of ``rows``."""
    path.mkdir()
    (path / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 5, "loss": 2.0}) + "\n")
    if rows is not None:
        (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_report_names_each_run_and_task_it_leaves_out(capsys, tmp_path):
    """A run dir with no eval.jsonl, and rows with no headline number (LongPPL of 0 key tokens), are
    each one line with the reason, the flag to change where the row says why; the rest is plotted."""
    loss = [{"task": "loss", "bpb": 2.5 - s / 100, "checkpoint_step": s, "tokens_seen": 128 * s, "eval_key": "a"}
            for s in (5, 10)]
    longppl = [{"task": "longppl", "longppl": None, "ppl": 9.0, "n_key": 0, "n_token": 1024, "length": 129,
                "trunc_len": 64, "checkpoint_step": s, "tokens_seen": 128 * s, "eval_key": "b"} for s in (5, 10)]
    sa, gdn = _run_dir(tmp_path / "sa", loss + longppl), _run_dir(tmp_path / "gdn", loss)
    quick = _run_dir(tmp_path / "quickstart")
    assert main(["eval-report", str(sa), str(gdn), str(quick), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    skipped = [x for x in out.splitlines() if x.startswith("skipped")]
    assert len(skipped) == 2, out
    assert skipped[0].startswith(f"skipped longppl of {sa}: 2 rows without a headline number (LongPPL undefined: "
                                 "the evaluator found 0 key tokens (key 0/1024") and "--longppl-length" in skipped[0]
    assert skipped[1].startswith(f"skipped run {quick} (") and ": no eval.jsonl (`hybrid-lm eval " \
        f"{quick} --tasks loss --steps all` writes them)" in skipped[1]
    assert "2 checkpoints" in out and len(list((tmp_path / "rep").glob("loss_*.png"))) == 1


def test_eval_report_refuses_an_unknown_task(capsys, tmp_path):
    """--tasks names eval tasks, checked as `hybrid-lm eval --tasks` checks them: one line, exit 2."""
    _run_dir(tmp_path / "run", [{"task": "loss", "bpb": 2.5, "checkpoint_step": 5, "tokens_seen": 640}])
    rc = main(["eval-report", str(tmp_path / "run"), "--tasks", "loss,nope"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert "--tasks loss,nope: unknown nope; choose from loss,longppl,ruler" in err


@pytest.mark.parametrize("args, msg", [
    (["--tasks", "loss,nope"], "unknown nope"),
    (["--steps", "7"], "no checkpoint at step 7"),
    (["--steps", "x"], "give latest, all"),
    (["--tasks", "ruler", "--data", "/nonexistent"], "--data applies to the loss, longppl and influence"),
    (["--tasks", "loss", "--data", "/nonexistent"], "no prepared token store"),
    (["--tasks", "lm_eval"], "needs --lm-eval-tasks"),
    (["--tasks", "ruler", "--ruler-lengths", "1K"], "use shorter --ruler-lengths, or --allow-longer"),
    (["--tasks", "ruler", "--ruler-lengths", "1x"], "--ruler-lengths: '1x' is not a positive length"),
    (["--tasks", "loss", "--swap", "full=nope:3"], "nope"),
    (["--tasks", "loss", "--baseline"], "--baseline applies without --tasks"),
])
def test_bad_requests_are_one_line_errors(capsys, run_dir, args, msg):
    rc, _, err = _eval(capsys, run_dir, *args)
    assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_every_task_option_is_checked_before_any_task_runs(capsys, run_dir, monkeypatch):
    """`--tasks ruler,probe --samples 4` fails on the probe's minimum before a checkpoint is restored
    or a RULER item built, as do a LongPPL --trunc-len beyond the documents, heads on a model with no
    full attention and a RULER length beyond seq_len: one line, exit 2, nothing recorded."""
    from hybrid_lm.run import restore

    def restored(*_, **__):
        raise AssertionError("a checkpoint was restored before every task's options were checked")

    monkeypatch.setattr(restore.RestoredRun, "__init__", restored)
    rows = run_dir / "eval.jsonl"
    before = rows.read_text() if rows.exists() else None
    for args, msg in [
        (["--tasks", "ruler,probe", "--ruler-lengths", "1K", "--allow-longer", "--samples", "4", "--ruler-tasks",
          "niah_single,vt", "--seq-len", "512"], "probe: samples=4; the probe needs at least 40"),
        (["--tasks", "loss,longppl"], "longppl: documents of 33 tokens leave no token beyond the short context"),
        (["--tasks", "loss,heads", "--swap", "full=swa:4"], "heads: no full-attention layer"),
        (["--tasks", "loss,ruler", "--ruler-lengths", "1K"], "exceed the run's seq_len 32"),
    ]:
        rc, _, err = _eval(capsys, run_dir, *args)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1, (args, err)
    assert "--samples applies to every task of --tasks" in _eval(capsys, run_dir, "--tasks", "probe,heads",
                                                                 "--samples", "8")[2]
    assert (rows.read_text() if rows.exists() else None) == before


def test_not_a_run_dir(capsys, tmp_path):
    rc, _, err = _eval(capsys, tmp_path, "--tasks", "loss")
    assert rc == 2 and "not a run directory" in err
    rc = main(["eval-report", str(tmp_path)])
    assert rc == 2 and "no run directory" in capsys.readouterr().err

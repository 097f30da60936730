"""The suite's plots say what they draw: longppl.png with no key tokens is titled as plain perplexity,
the RULER plot of one checkpoint draws its lengths on the x axis with the legend beside the axes, and
the RULER table explains its gold-beats-distractors rows. eval-report's figures are titled by their
eval settings, draw bars where each run has one checkpoint, keep runs apart past ten, plot RULER's
answer NLL where there is no exact match and name each task's metric."""

from pathlib import Path

import pytest

from hybrid_lm.eval import ruler_items as RI
from hybrid_lm.eval.ruler_report import format_table
from hybrid_lm.eval import suite


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions save, kept open for inspection."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig

    def keep(self, *args, **kw):
        saved.append(self)
        return original(self, *args, **kw)
    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _longppl_row(step, n_key):
    return {"task": "longppl", "kind": "longppl", "checkpoint_step": step, "tokens_seen": step * 1000,
            "longppl": 3.0 if n_key else None, "ppl": 9.0 - step / 100, "n_key": n_key, "n_token": 1000}


def test_longppl_plot_without_key_tokens_is_titled_as_perplexity(figures, tmp_path: Path):
    (path,) = suite.plot_task("longppl", [_longppl_row(100, 0), _longppl_row(200, 0)], tmp_path)
    ax = figures[-1].axes[0]
    assert path.name == "longppl.png" and "no key tokens" in ax.get_title() and "LongPPL" in ax.get_title()
    assert ax.get_ylabel() == "perplexity (lower is better)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ppl (all tokens)"]
    suite.plot_task("longppl", [_longppl_row(100, 5), _longppl_row(200, 7)], tmp_path)
    ax = figures[-1].axes[0]
    assert ax.get_title() == "LongPPL (key tokens) and PPL (all tokens) over training"
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["longppl (key tokens)", "ppl (all tokens)"]
    suite.plot_task("longppl", [_longppl_row(100, 0)], tmp_path)  # one checkpoint: a log axis around it
    lo, hi = figures[-1].axes[0].get_xlim()
    assert lo == pytest.approx(50_000) and hi == pytest.approx(200_000)


def _ruler_rows(steps, lengths):
    return [{"task": f"ruler/{t}", "checkpoint_step": s, "tokens_seen": 100_000_000 + s, "length": n,
             "exact_match": 0.0, "answer_nll": 4.0 + i / 10} for s in steps for n in lengths
            for i, t in enumerate(RI.TASKS)]


@pytest.mark.parametrize("lengths", [[4096], [4096, 8192, 16384]])
def test_ruler_plot_of_one_checkpoint_draws_the_lengths_and_keeps_the_legend_off_the_points(figures, tmp_path,
                                                                                            lengths):
    (path,) = suite.plot_task("ruler", _ruler_rows([60], lengths), tmp_path)
    fig = figures[-1]
    left, right = fig.axes
    assert path.name == "ruler.png" and "at step 60" in fig._suptitle.get_text()
    assert right.get_xlabel() == "context length (tokens)"
    assert [t.get_text() for t in right.get_xticklabels()] == [f"{n // 1024}K" for n in lengths]
    lo, hi = right.get_xlim()
    assert lo < min(lengths) and hi > max(lengths) and hi / lo < 2 * max(lengths) / min(lengths) + 2.3
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    for ax in (left, right):  # the legend sits beside both axes, over no point
        assert legend.x0 >= ax.get_window_extent().x1
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == sorted(RI.TASKS)


def test_ruler_plot_over_checkpoints_draws_tokens_seen(figures, tmp_path):
    suite.plot_task("ruler", _ruler_rows([30, 60], [4096]), tmp_path)
    fig = figures[-1]
    assert fig.axes[1].get_xlabel() == "tokens seen" and fig.axes[1].get_xscale() == "log"
    assert "over training" in fig._suptitle.get_text() and len(fig.legends[0].get_texts()) == len(RI.TASKS)


def test_ruler_rows_of_each_length_stay_current(tmp_path):
    """One request writes a row per task and length: none supersedes another."""
    import json

    rows = [{**r, "eval_key": "k"} for r in _ruler_rows([60], [4096, 8192])]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:1]))
    assert len(suite.current_rows(tmp_path)) == len(rows)


def test_ruler_table_explains_gold_beats_distractors():
    row = {"task": "ruler/niah_multikey", "checkpoint_step": 5, "samples": 2, "seed": 0, "haystack": "essays",
           "generation": "greedy", "length": 4096, "exact_match": 0.0, "answer_nll": 4.0, "ll_accuracy": 0.5,
           "ll_chance": 0.25}
    text = format_table([row])
    assert "gold beats distractors (chance)" in text and "0.50 (0.25)" in text
    flat = " ".join(text.split())  # the explanation is wrapped
    assert "higher log-likelihood than each of the task's wrong answers" in flat and "1 / (1 + wrong answers)" in flat


# ----------------------------------------------------------------------------- eval-report

def _conf(task, **kw):
    """A row's eval_config as `hybrid-lm eval --tasks TASK` writes it, with ``kw`` changed."""
    from hybrid_lm.eval.suite import EvalRequest, eval_key
    c = {**EvalRequest(tasks=(task,)).config(task), **kw}
    return {"eval_config": c, "eval_key": eval_key(c)}


def _report_rows(task, value, steps=(458,), **conf):
    """Rows of ``task`` at ``steps`` (131,072 tokens a step), ``value(step)`` their numbers."""
    fam = task.split("/")[0]
    return [{"task": task, "checkpoint_step": s, "tokens_seen": 131_072 * s, **value(s), **_conf(fam, **conf)}
            for s in steps]


def _runs(tmp_path, rows_of):
    """Run dirs r00, r01, ... (one per entry of ``rows_of``: its eval.jsonl rows) under ``tmp_path/study``."""
    import json
    root = tmp_path / "study"
    for i, rows in enumerate(rows_of):
        d = root / f"r{i:02d}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 1, "loss": 2.0}) + "\n")
        (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _report(root, out):
    from hybrid_lm.eval.report import eval_report
    lines = []
    paths = eval_report([root], out, printer=lines.append)
    return paths, "\n".join(lines)


def _bpb(s):
    return {"bpb": 1.0 + 100 / s, "loss": 2.0}


def test_eval_report_titles_each_figure_by_its_non_default_settings(figures, tmp_path):
    rows = (_report_rows("loss", _bpb) + _report_rows("loss", _bpb, swaps=["full=sa:128"])
            + _report_rows("loss", _bpb, seq_len=8192)
            + _report_rows("loss", _bpb, swaps=["full=swa:128", "efficient=sa:64"], horizon=512, sinks=4)
            + _report_rows("longppl", lambda s: {"longppl": 20.0, "n_key": 14}, evaluator="/runs/study/s1-full",
                           trunc_len=1024, window=512))
    paths, out = _report(_runs(tmp_path, [rows, rows]), tmp_path / "rep")
    titles = {p.name: f.axes[0].get_title() for p, f in zip(paths, figures)}
    by_key = {r["eval_key"]: r for r in rows}
    assert len(titles) == 5
    for name, t in titles.items():
        key = name.removesuffix(".png").rsplit("_", 1)[1]
        assert key in by_key, name  # the eval key stays in the file name ...
        fig = figures[paths.index(tmp_path / "rep" / name)]
        assert any(f"eval config {key}" in x.get_text() for x in fig.texts)  # ... and in small print
        assert "eval config" not in t
    assert sorted(titles.values()) == sorted([
        "loss", "loss — --swap full=sa:128", "loss — --seq-len 8192",
        "loss — --swap full=swa:128 --swap efficient=sa:64 --horizon 512 --sinks 4",
        "longppl — --evaluator s1-full --trunc-len 1024 --window 512"])
    assert "loss_seq-len-8192_" in " ".join(titles) and "loss — --swap full=sa:128  [eval config" in out


def test_eval_report_titles_ruler_figures_by_length_and_generation(figures, tmp_path):
    """One request of two lengths is two figures; --ruler-no-generation and --swap-prefill-only are named."""
    def nll(step):
        return {"exact_match": None, "answer_nll": 7.0, "generation": "unavailable (not asked)"}

    rows = [{**r, "length": n} for n in (4096, 8192) for r in _report_rows(
        "ruler/niah_single", nll, lengths=[4096, 8192], samples=8, generation=False)]
    rows += [{**r, "length": 4096} for r in _report_rows(
        "ruler/niah_single", nll, swaps=["full=sa:128"], lengths=[4096], swap_prefill_only=True, generation=False)]
    paths, _ = _report(_runs(tmp_path, [rows]), tmp_path / "rep")
    assert sorted(f.axes[0].get_title().replace("\n", " ") for f in figures) == [
        "ruler/niah_single at 4K tokens — --samples 8 --ruler-no-generation",
        "ruler/niah_single at 4K tokens — --swap full=sa:128 --swap-prefill-only --ruler-no-generation",
        "ruler/niah_single at 8K tokens — --samples 8 --ruler-no-generation"]
    assert len({p.name for p in paths}) == 3


def test_eval_report_of_one_checkpoint_per_run_draws_a_bar_per_run(figures, tmp_path):
    runs = [_report_rows("longppl", lambda s, v=v: {"longppl": v, "n_key": 14}) for v in (21.3, 157.8, 2.6)]
    _report(_runs(tmp_path, runs), tmp_path / "rep")
    (ax,) = figures[-1].axes
    assert len(ax.patches) == 3 and not ax.get_lines()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["r00", "r01", "r02"]
    assert ax.yaxis_inverted()  # the first label on top
    widths = [b.get_x() + b.get_width() for b in ax.patches]
    assert widths == pytest.approx([21.3, 157.8, 2.6])
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "LongPPL (perplexity), lower is better"
    assert sorted(t.get_text() for t in ax.texts) == ["157.8", "2.6", "21.3"]  # the value at each bar's end
    assert ax.get_xlim()[0] <= 1 and ax.get_xlim()[1] > 157.8
    assert any("at 60.0M tokens seen (step 458)" in t.get_text() for t in figures[-1].texts)

    # one run with two checkpoints: curves over tokens seen again
    runs[0] = _report_rows("longppl", lambda s: {"longppl": 30.0 - s / 100, "n_key": 14}, steps=(229, 458))
    _report(_runs(tmp_path / "2", runs), tmp_path / "rep2")
    (ax,) = figures[-1].axes
    assert len(ax.get_lines()) == 3 and not ax.patches
    assert ax.get_xlabel() == "tokens seen" and ax.get_xscale() == "log" and ax.get_yscale() == "log"


@pytest.mark.parametrize("steps", [(458,), (229, 458)])
def test_eval_report_gives_every_run_its_own_look_past_ten_runs(figures, tmp_path, steps):
    n = 25 if len(steps) > 1 else 13
    runs = [_report_rows("loss", lambda s, i=i: {"bpb": 1.0 + i / 100 + 1 / s}, steps) for i in range(n)]
    _report(_runs(tmp_path, runs), tmp_path / "rep")
    (ax,) = figures[-1].axes
    from matplotlib.colors import to_hex
    if len(steps) == 1:
        looks = [to_hex(b.get_facecolor()) for b in ax.patches]
    else:
        looks = [(to_hex(line.get_color()), line.get_marker()) for line in ax.get_lines()]
        assert len({c for c, _ in looks[:20]}) == 20  # tab20: 20 colours before a marker changes
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"r{i:02d}" for i in range(n)]
    assert len(looks) == n and len(set(looks)) == n


def test_eval_report_plots_ruler_answer_nll_where_there_is_no_exact_match(figures, tmp_path):
    """Log-likelihood-only RULER rows are plotted as answer NLL, never on the exact-match axes (even
    under one eval key); rows with neither are still skipped with the reason."""
    em = _report_rows("ruler/vt", lambda s: {"exact_match": 0.5, "answer_nll": 3.0, "generation": "greedy"},
                      lengths=[4096])
    no_gen = _report_rows("ruler/vt", lambda s: {"exact_match": None, "answer_nll": 7.25,
                                                 "generation": "unavailable (not asked (--ruler-no-generation))"},
                          lengths=[4096], generation=False)
    mixed = [{**r, "exact_match": None, "checkpoint_step": 400} for r in em]  # one key, EM lost at one step
    nothing = _report_rows("ruler/cwe", lambda s: {"exact_match": None, "generation": "unavailable (x)"})
    rows = [{**r, "length": 4096} for r in em + no_gen + mixed + nothing]
    paths, out = _report(_runs(tmp_path, [rows]), tmp_path / "rep")
    from hybrid_lm.eval.report import collect_eval
    groups = collect_eval([tmp_path / "study"])
    assert sorted((g.task, g.eval_key, g.metric) for g in groups) == sorted([
        ("ruler/vt", em[0]["eval_key"], "exact_match"), ("ruler/vt", em[0]["eval_key"], "answer_nll"),
        ("ruler/vt", no_gen[0]["eval_key"], "answer_nll")])
    labels = sorted(f.axes[0].get_xlabel() for f in figures)
    assert labels == ["answer NLL (nats, lower is better)"] * 2 + ["exact match (share of items), higher is better"]
    nll_fig = next(f for p, f in zip(paths, figures) if no_gen[0]["eval_key"] in p.name)
    assert "answer_nll" in paths[figures.index(nll_fig)].name
    assert [t.get_text() for t in nll_fig.axes[0].texts] == ["7.25"]
    assert "skipped ruler/vt" not in out and "skipped ruler/cwe" in out and "no exact match: generation" in out


def test_eval_report_heads_axis_names_the_metric(figures, tmp_path):
    from hybrid_lm.eval.heads import HEADLINE
    rows = _report_rows("heads", lambda s: {HEADLINE: s / 1e5}, steps=(143, 286), samples=100)
    _report(_runs(tmp_path, [rows]), tmp_path / "rep")
    ax = figures[-1].axes[0]
    assert ax.get_ylabel() == f"{HEADLINE}, higher is better" and "headline" not in ax.get_ylabel()
    assert ax.get_title() == "heads — --samples 100"


def test_run_labels_of_a_copied_sweep_name_arch_and_seed(tmp_path):
    """A copy of a sweep's results files (no sweep_run.json per run, as docs/results/study) labels each run
    from the root's sweep.json: arch, scale and a non-zero seed, so replicates are told apart."""
    import json

    from hybrid_lm.eval.report import run_label

    root = _runs(tmp_path, [[], [], []])
    jobs = [{"name": "r00", "arch": "full", "scale": "S1", "seed": 0},
            {"name": "r01", "arch": "full", "scale": "S1", "seed": 1},
            {"name": "r02", "arch": "full_rerun", "scale": "S1", "seed": 0}]
    (root / "sweep.json").write_text(json.dumps({"jobs": jobs}))
    assert [run_label(root / f"r0{i}") for i in range(3)] == ["full S1", "full S1 seed 1", "full_rerun S1"]
    (root / "r01" / "sweep_run.json").write_text(json.dumps({"arch": "swa128", "scale": "S2", "seed": 3}))
    assert run_label(root / "r01") == "swa128 S2 seed 3"  # the run's own file first

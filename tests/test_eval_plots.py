"""The suite's plots say what they draw: longppl.png with no key tokens is titled as plain perplexity,
the RULER plot of one checkpoint draws its lengths on the x axis with the legend beside the axes, and
the RULER table explains its gold-beats-distractors rows."""

from pathlib import Path

import pytest

from hybrid_lm.eval import ruler as R
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
            for i, t in enumerate(R.TASKS)]


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
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == sorted(R.TASKS)


def test_ruler_plot_over_checkpoints_draws_tokens_seen(figures, tmp_path):
    suite.plot_task("ruler", _ruler_rows([30, 60], [4096]), tmp_path)
    fig = figures[-1]
    assert fig.axes[1].get_xlabel() == "tokens seen" and fig.axes[1].get_xscale() == "log"
    assert "over training" in fig._suptitle.get_text() and len(fig.legends[0].get_texts()) == len(R.TASKS)


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
    text = R.format_table([row])
    assert "gold beats distractors (chance)" in text and "0.50 (0.25)" in text
    flat = " ".join(text.split())  # the explanation is wrapped
    assert "higher log-likelihood than each of the task's wrong answers" in flat and "1 / (1 + wrong answers)" in flat

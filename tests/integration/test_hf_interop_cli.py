"""transformers interop on the command line: ``hybrid-lm export --format hf`` of a trained run, then
``eval`` / ``generate`` / the lm-eval model on ``hf:DIR`` (the run's own numbers, swaps included) and
``train --init-from hf:DIR`` (the folder's parameters, its identity, a gin that disagrees refused)."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from hybrid_lm.cli import main
from hybrid_lm.run.hf import HFCheckpoint


@pytest.fixture(scope="module")
def run_and_folder(tiny_run, tmp_path_factory):
    """A trained TINY run (1:1 attention + SWA 8: a Ministral) and its ``--format hf`` export."""
    run = tiny_run(5)
    out = tmp_path_factory.mktemp("hf") / "tiny-hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    return run, out


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_export_writes_a_transformers_folder(run_and_folder, tmp_path, capsys):
    from hybrid_lm.run.restore import RestoredRun

    run, out = run_and_folder
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MinistralForCausalLM"] and cfg["sliding_window"] == 8
    assert cfg["layer_types"] == ["full_attention", "sliding_attention"] and cfg["hybrid_lm"]["step"] == 5
    restored, imported = RestoredRun(run), RestoredRun(f"hf:{out}")
    assert imported.cfg.model == restored.cfg.model and imported.step == 0
    assert all(np.array_equal(a, b) for a, b in zip(_leaves(restored.params), _leaves(imported.params)))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)
    assert np.array_equal(np.asarray(restored.model()(tokens)), np.asarray(imported.model()(tokens)))
    # the default output, and --force replacing an earlier export
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    assert main(["export", str(copy), "--format", "hf", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["out"] == str(copy / "export" / "step_5-hf")
    assert main(["export", str(copy), "--format", "hf", "--force"]) == 0
    assert "as transformers MinistralForCausalLM" in capsys.readouterr().out


def test_eval_and_generate_on_the_folder(run_and_folder, capsys):
    from hybrid_lm.run.restore import RestoredRun

    run, out = run_and_folder
    ours = RestoredRun(run).evaluate(eval_windows=16, record=False)
    theirs = RestoredRun(f"hf:{out}").evaluate(eval_windows=16, record=False)  # other batches, same windows
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5) and theirs["step"] == 0
    assert main(["eval", f"hf:{out}", "--swap", "full=sa:8", "--eval-windows", "16", "--no-record", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["swaps"] == ["full=sa:8"] and np.isfinite(row["loss"]) and not (out / "eval.jsonl").exists()
    args = ["--prompt", "The", "--max-new", "6", "--json"]
    assert main(["generate", str(run)] + args) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", f"hf:{out}"] + args) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want


def test_lm_eval_model_on_the_folder(run_and_folder):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from hybrid_lm.eval.lm_eval_model import model_class

    run, out = run_and_folder
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=("The quick brown", " fox"), idx=0),
            Instance(request_type="loglikelihood", doc={}, arguments=("Once upon a", " time there"), idx=1)]
    ours = model_class()(run=str(run), batch_size=2, progress=False).loglikelihood(reqs)
    theirs = model_class()(run=f"hf:{out}", batch_size=2, progress=False).loglikelihood(reqs)
    assert theirs == ours


def test_train_from_the_folder(run_and_folder, tmp_path, capsys):
    from conftest import TINY

    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.run.checkpoint import params_fingerprint

    run, out = run_and_folder
    # the gin leaves the model out (the folder's config.json gives it) and sets the rest
    rest = [p for p in TINY if not p.startswith(("ModelConfig", "efficient/"))]
    args = ["train", "base.gin", "--workdir", str(tmp_path / "cont"), "--init-from", f"hf:{out}"]
    for p in rest + ["ModelConfig.compute_dtype = 'float32'", "TrainConfig.steps = 2"]:
        args += ["--gin_param", p]
    assert main(args) == 0
    identity = HFCheckpoint(out).identity
    record = json.loads((tmp_path / "cont" / "config.json").read_text())
    source = json.loads((run / "config.json").read_text())
    assert record["train"]["init_from"] == identity and identity.startswith("hf:")
    for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "layer_pattern", "full", "efficient"):
        assert record["model"][f] == source["model"][f], f
    prov = json.loads((tmp_path / "cont" / "provenance.json").read_text())["init_from"]
    assert prov["kind"] == "hf" and prov["identity"] == identity and prov["source_dir"] == str(out.resolve())
    assert prov["params_fingerprint"] == params_fingerprint(RestoredRun(f"hf:{out}").params)  # it started there
    assert f"parameters of the Hugging Face folder {out.resolve()} ({identity}" in capsys.readouterr().out
    # a gin that sets a shape the folder contradicts: one line, nothing written
    bad = args[:3] + [str(tmp_path / "bad")] + args[4:] + ["--gin_param", "ModelConfig.d_model = 48"]
    assert main(bad) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("config error")]
    assert len(err) == 1 and "the gin sets d_model=48 (config.json: 32)" in err[0]
    assert not (tmp_path / "bad").exists()


def test_the_eval_suite_ruler_and_longppl_on_the_folder(run_and_folder, tmp_path, capsys):
    """``eval --tasks``, ``ruler`` and ``longppl`` take ``hf:DIR``: one checkpoint (step 0); rows and plots
    go into the folder."""
    _, out = run_and_folder
    folder = tmp_path / "folder"
    shutil.copytree(out, folder)
    longppl = ["--trunc-len", "8", "--window", "8", "--docs", "2", "--inputs", "windows"]
    assert main(["eval", f"hf:{folder}", "--tasks", "loss,longppl", "--eval-windows", "16", "--no-plots",
                 "--trunc-len", "8", "--window", "8", "--docs", "2", "--longppl-inputs", "windows"]) == 0
    rows = [json.loads(x) for x in (folder / "eval.jsonl").read_text().splitlines()]
    assert {(r["task"], r["checkpoint_step"], r["tokens_seen"]) for r in rows} == {("loss", 0, 0), ("longppl", 0, 0)}
    capsys.readouterr()
    assert main(["ruler", f"hf:{folder}", "--tasks", "niah_single", "--lengths", "768", "--allow-longer",
                 "--samples", "1", "--no-record", "--json"]) == 0
    assert [r["task"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["ruler/niah_single"]
    assert main(["longppl", f"hf:{folder}", "--no-record", "--json"] + longppl) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint_step"] == 0


def test_every_reported_loss_names_its_data_and_a_folder_with_its_own_tokenizer_needs_a_choice(
        run_and_folder, tmp_path, capsys):
    """``eval`` prints and records what it scored. A folder that brings its own tokenizer has no data of its
    own: ``eval hf:DIR`` without ``--data`` refuses in one line (the embedded essays through its tokenizer
    compare with nothing it was trained on) and ``--data embedded`` asks for them explicitly."""
    from hf_families import random_params, tiny_model
    from hybrid_lm.data.sources import embedded_documents
    from hybrid_lm.data.tokenizer import train_bpe
    from hybrid_lm.run.hf import write_hf_folder

    run, _ = run_and_folder
    assert main(["eval", str(run), "--no-record"]) == 0
    assert "on embedded val split" in capsys.readouterr().out
    tok = train_bpe(iter(t for _, t in embedded_documents()[:20]), 300, tmp_path / "tok")
    model = tiny_model("llama")  # vocabulary 320
    out = tmp_path / "hf"
    out.mkdir()
    write_hf_folder(out, model, random_params(model), tokenizer=str(tok), seq_len=32)
    assert (out / "tokenizer.json").is_file()
    capsys.readouterr()
    for args in ([], ["--tasks", "loss"]):
        assert main(["eval", f"hf:{out}", "--no-record", *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "its own tokenizer" in err[0] and "--data STORE" in err[0] \
            and "--data embedded" in err[0], err
    assert main(["eval", f"hf:{out}", "--data", "embedded", "--eval-windows", "8", "--no-record", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["scored_on"] == f"embedded val split, tokenizer {out}" and np.isfinite(row["loss"])


def test_export_check_compares_logits_through_transformers(run_and_folder, tmp_path, capsys):
    """``export --format hf --check``: the logits of a prompt through transformers against hybrid_lm's, the
    relative error printed, exit 1 past the bound. Where torch or transformers does not import, the check is
    refused in one line before anything is written, and only that case skips."""
    import importlib.util

    run, _ = run_and_folder
    out = tmp_path / "checked"
    rc = main(["export", str(run), "--format", "hf", "--out", str(out), "--check"])
    cap = capsys.readouterr()
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        err = cap.err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "--check needs torch and transformers" in err[0], cap.err
        assert not out.exists()
        pytest.skip("torch or transformers does not import here: --check said so in one line")
    assert rc == 0, cap.err[-2000:]
    line = next(x for x in cap.out.splitlines() if x.startswith("check "))
    assert "MinistralForCausalLM" in line and "rel err" in line and line.endswith("OK"), line
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "again"), "--check",
                 "--check-bound", "0"]) == 1
    assert "past the bound" in capsys.readouterr().out

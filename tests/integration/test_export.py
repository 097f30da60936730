"""``hybrid-lm export`` (hybrid_lm/run/export.py): a checkpoint as safetensors + config.json, read back
into a HybridLM with the checkpoint's logits; bf16; atomic, never overwriting without --force; bad
inputs in one line."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hybrid_lm.errors import ConfigError, WorkdirError
from hybrid_lm.run import export as X
from hybrid_lm.experiment import run_id


def test_names_round_trip():
    tree = {"blocks": {0: {"mixer": {"wq": 1}}, 1: {"mlp": {"w_up": 2}}}, "embed": {"table": 3}, "lm_head": 4}
    flat = X.flatten_params(tree)
    assert flat == {"blocks.0.mixer.wq": 1, "blocks.1.mlp.w_up": 2, "embed.table": 3, "lm_head": 4}
    assert X.unflatten_params(flat) == tree
    assert X.parse_run_spec("runs/a@12") == (Path("runs/a"), 12)
    assert X.parse_run_spec("runs/a@latest") == (Path("runs/a"), None)
    assert X.parse_run_spec("runs/a") == (Path("runs/a"), None)
    with pytest.raises(ConfigError, match="@STEP"):
        X.parse_run_spec("runs/a@-3")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("export_run")
    train(load_config([], list(TINY) + ["TrainConfig.steps = 4", "CheckpointConfig.every_steps = 2"]), wd)
    return wd


def _logits(model, tokens):
    return np.asarray(model(tokens))


def test_round_trip(run_dir, tmp_path):
    from hybrid_lm.run.restore import RestoredRun
    from hybrid_lm.run.checkpoint import params_fingerprint

    wd = tmp_path / "run"
    shutil.copytree(run_dir, wd)
    out = X.export_checkpoint(str(wd))
    assert out == wd / "export" / "step_4" and sorted(p.name for p in out.iterdir()) == ["config.json",
                                                                                        "model.safetensors"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    run = RestoredRun(wd)
    params, cfg = X.load_exported(out)
    meta = cfg.pop("export")
    assert cfg == json.loads((wd / "config.json").read_text())
    assert meta["step"] == 4 and meta["run_id"] == run_id(run.cfg) and meta["dtype"] == "float32"
    assert meta["hybrid_lm_version"] and meta["params_fingerprint"] == params_fingerprint(run.params)
    want = X.flatten_params(run.params)
    got = X.flatten_params(params)
    assert set(got) == set(want) and "blocks.0.mixer.wq" in got and "embed.table" in got
    for name, a in want.items():
        assert got[name].dtype == np.float32 and np.array_equal(got[name], np.asarray(a)), name
        assert meta["params"][name]["shape"] == list(a.shape)
    assert meta["params"]["blocks.0.mixer.wq"]["axes"] == ["embed", "heads", "head_dim"]
    assert params_fingerprint(params) == meta["params_fingerprint"]

    tokens = np.asarray(run.streams().eval_batch[:2, :-1])
    model, mcfg = X.exported_model(out / "model.safetensors")
    assert mcfg.model == run.cfg.model
    assert np.array_equal(_logits(model, tokens), _logits(run.model(), tokens))

    # an older step, in bf16
    old = X.export_checkpoint(f"{wd}@2", dtype="bf16")
    assert old == wd / "export" / "step_2"
    p2, c2 = X.load_exported(old)
    run2 = RestoredRun(wd, step=2)
    w2 = np.asarray(run2.params["blocks"][0]["mixer"]["wq"])
    assert c2["export"]["step"] == 2 and c2["export"]["dtype"] == "bfloat16"
    wq = p2["blocks"][0]["mixer"]["wq"]
    assert str(wq.dtype) == "bfloat16" and np.array_equal(wq, w2.astype(wq.dtype))  # rounded, nothing else
    assert not np.array_equal(w2, np.asarray(run.params["blocks"][0]["mixer"]["wq"]))  # step 2 is not step 4
    m2, _ = X.exported_model(old)
    np.testing.assert_allclose(_logits(m2, tokens), _logits(run2.model(), tokens), atol=0.05)


def test_existing_out_and_atomic_write(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "exp"
    X.export_checkpoint(f"{run_dir}@4", out=out)
    first = (out / "model.safetensors").stat().st_size
    n_params = json.loads((out / "config.json").read_text())["export"]["n_params"]
    with pytest.raises(WorkdirError, match="already exists.*--force"):
        X.export_checkpoint(f"{run_dir}@4", out=out)
    X.export_checkpoint(f"{run_dir}@2", out=out, force=True)
    assert json.loads((out / "config.json").read_text())["export"]["step"] == 2
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(WorkdirError, match="not an earlier export"):
        X.export_checkpoint(str(run_dir), out=other, force=True)
    assert (other / "keep.txt").read_text() == "mine"

    import safetensors.numpy

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(OSError):
        X.export_checkpoint(f"{run_dir}@4", out=out, force=True)  # fails midway: the old export stays
    assert json.loads((out / "config.json").read_text())["export"]["step"] == 2
    with pytest.raises(OSError):
        X.export_checkpoint(f"{run_dir}@4", out=tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "notes"]  # nothing half-written
    assert first > 4 * n_params  # the first export held every fp32 parameter (and a header)


def _one_line_error(main, capsys, *argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip() and not x.startswith("WARNING")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_cli(run_dir, tmp_path, capsys):
    from hybrid_lm.cli import main

    out = tmp_path / "cli"
    assert main(["export", str(run_dir), "--out", str(out), "--dtype", "bf16"]) == 0
    assert "exported step 4" in capsys.readouterr().out
    assert X.load_exported(out)[1]["export"]["dtype"] == "bfloat16"
    assert main(["export", f"{run_dir}@2", "--out", str(out), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2

    assert "already exists" in _one_line_error(main, capsys, "export", f"{run_dir}@2", "--out", str(out))
    assert "format 'onnx'" in _one_line_error(main, capsys, "export", str(run_dir), "--format", "onnx")
    assert "dtype 'fp8'" in _one_line_error(main, capsys, "export", str(run_dir), "--dtype", "fp8")
    assert "@STEP" in _one_line_error(main, capsys, "export", f"{run_dir}@two")
    assert "no checkpoint at step 3; saved steps: [2, 4]" in _one_line_error(main, capsys, "export", f"{run_dir}@3")
    assert "no run directory" in _one_line_error(main, capsys, "export", str(tmp_path / "nothing"))
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "no config.json" in _one_line_error(main, capsys, "export", str(bare))
    shutil.copy(run_dir / "config.json", bare / "config.json")
    assert "no checkpoint" in _one_line_error(main, capsys, "export", str(bare))
    with pytest.raises(WorkdirError, match="not an export"):
        X.load_exported(bare)

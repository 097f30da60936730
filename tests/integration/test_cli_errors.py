"""User mistakes on the eval side are one line with exit 2 (``--debug`` shows the traceback): a
corrupt checkpoint asked for by ``--step``, a run dir that cannot be written (the result is printed
first), and a missing store or path for any command."""

import shutil

import pytest

from hybrid_lm.cli import main
from hybrid_lm.experiment import config_record
from resume_check import make_unwritable



@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, _data_dir):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train

    wd = tmp_path_factory.mktemp("cli_errors_run")
    train(load_config([], list(TINY) + ["TrainConfig.steps = 4", "CheckpointConfig.every_steps = 2"]), wd)
    return wd


def one_line(capsys, *argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip() and not x.startswith("WARNING")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_eval_of_a_corrupt_step_is_one_line_naming_it(run_dir, tmp_path, capsys):
    wd = tmp_path / "run"
    shutil.copytree(run_dir, wd)
    for f in (wd / "checkpoints" / "2").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage" * 10)
    msg = one_line(capsys, "eval", str(wd), "--step", "2")
    assert "the checkpoint at step 2" in msg and "does not restore" in msg and "other saved steps: [4]" in msg
    with pytest.raises(Exception):
        main(["--debug", "eval", str(wd), "--step", "2"])


def test_eval_on_an_unwritable_run_dir_prints_the_result_then_one_line(run_dir, tmp_path, capsys):
    wd = tmp_path / "run"
    shutil.copytree(run_dir, wd)
    undo = make_unwritable(wd)
    if undo is None:
        pytest.skip("cannot make a directory read-only here")
    try:
        rc = main(["eval", str(wd)])
    finally:
        undo()
    out = capsys.readouterr()
    assert rc == 2 and "val loss" in out.out and "bits/byte" in out.out
    assert "could not be appended to" in out.err and "--no-record" in out.err and "Traceback" not in out.err


def test_missing_inputs_are_one_line_for_every_command(tmp_path, capsys):
    assert "no token store" in one_line(capsys, "data", "inspect", str(tmp_path / "nothing"))
    assert "nothing" in one_line(capsys, "eval", str(tmp_path / "nothing"))
    assert "gin file not found" in one_line(capsys, "train", str(tmp_path / "nope.gin"))
    assert "gin file not found" in one_line(capsys, "info", str(tmp_path / "nope.gin"))


def test_generate_warns_past_the_trained_context(run_dir, capsys, caplog):
    """TINY trains at seq_len 32: a 30-byte prompt + 10 new tokens runs past it, with a warning."""
    import logging

    with caplog.at_level(logging.WARNING, logger="hybrid_lm.generate"):
        assert main(["generate", str(run_dir), "--prompt", "x" * 30, "--max-new", "10"]) == 0
    assert any("exceeds the trained context (seq_len 32)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybrid_lm.generate"):
        assert main(["generate", str(run_dir), "--prompt", "x" * 10, "--max-new", "10"]) == 0
    assert not caplog.records


@pytest.mark.parametrize("text,what", [
    ("{bad", "is not JSON"), ("{}", "missing sections 'model'"), ('{"a": 1}', "missing sections 'model'"),
    ("[1]", "holds a JSON list"),
])
def test_a_corrupt_run_config_is_one_line_naming_it(tmp_path, capsys, text, what):
    """A hand-edited or torn DIR/config.json: every command that reads it says so in one line naming the
    file (exit 2), and none rewrites it."""
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.json").write_text(text)
    for argv in (["eval", str(wd), "--tasks", "loss"], ["eval", str(wd)], ["export", str(wd)],
                 ["ruler", str(wd), "--lengths", "1K"], ["generate", str(wd), "--prompt", "hi"],
                 ["longppl", str(wd)], ["train", "quickstart.gin", "--workdir", str(wd)]):
        msg = one_line(capsys, *argv)
        assert f"{wd / 'config.json'}" in msg and what in msg, (argv, msg)
        assert (wd / "config.json").read_text() == text
    assert sorted(p.name for p in wd.iterdir()) == ["config.json"]


def test_a_run_config_with_an_unknown_or_missing_field_names_it(tmp_path, capsys):
    import json

    from hybrid_lm.experiment import load_config

    good = config_record(load_config(["quickstart.gin"]))
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "config.json").write_text(json.dumps({**good, "model": {**good["model"], "colour": "red"}}))
    assert "unknown field model.colour" in one_line(capsys, "eval", str(wd))
    del good["model"]["full"]
    (wd / "config.json").write_text(json.dumps(good))
    assert "missing field 'full'" in one_line(capsys, "train", "quickstart.gin", "--workdir", str(wd))


def test_a_sweep_spec_that_is_not_toml_says_what_a_spec_is(tmp_path, capsys):
    from hybrid_lm.config import CONFIGS_DIR

    gin = CONFIGS_DIR / "quickstart.gin"
    msg = one_line(capsys, "sweep", str(gin), "--dry-run")
    assert f"{gin}: a sweep spec is a .toml file (see configs/sweeps/" in msg and ".gin file" in msg
    (tmp_path / "s.toml").write_text("name = [\n")
    assert f"{tmp_path / 's.toml'}: cannot parse as TOML (" in one_line(capsys, "sweep", str(tmp_path / "s.toml"),
                                                                       "--dry-run")

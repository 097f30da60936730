"""docs/MIXERS.md's mixer template, registered from outside the package: copied out of the page into
a module of its own, selected by a gin file that imports it, trained 2 steps, then evaluated by a
fresh process that imports the module recorded in config.json once the user names it (--mixer-module)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from hybrid_lm.config import MeshConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "MIXERS.md"


def _template():
    section = DOC.read_text().split("## Adding a mixer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    gin = re.search(r"```\n(import .*?)```", section, re.S).group(1)
    return section, code, gin


def test_the_template_trains_from_outside_the_package(tmp_path, monkeypatch):
    _, code, gin = _template()
    (tmp_path / "token_shift.py").write_text(code)
    (tmp_path / "shift.gin").write_text(gin + "TrainConfig.steps = 2\nTrainConfig.eval_every = 2\n"
                                        "DataConfig.eval_windows = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from hybrid_lm.experiment import load_config
    from hybrid_lm.train.loop import train

    cfg = load_config([str(tmp_path / "shift.gin")])
    assert cfg.model.efficient.kind == "token_shift" and cfg.model.efficient.options == {"mix": 0.25}
    work = tmp_path / "run"
    result = train(cfg, work)
    assert result.step == 2 and result.final_eval["loss"] > 0
    record = json.loads((work / "config.json").read_text())
    assert record["mixer_modules"] == ["token_shift"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "eval", str(work), "--no-record"],
                         capture_output=True, text=True, env=env, timeout=600)  # not named: not imported
    assert out.returncode == 2 and "--mixer-module token_shift" in out.stderr.strip().splitlines()[-1]
    out = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "--mixer-module", "token_shift", "eval", str(work),
                          "--json", "--no-record"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["step"] == 2
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")  # the module gone: one line naming it
    out = subprocess.run([sys.executable, "-m", "hybrid_lm.cli", "--mixer-module", "token_shift", "eval", str(work),
                          "--no-record"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 2 and "module 'token_shift', which does not import" in out.stderr.strip().splitlines()[-1]


def test_the_page_lists_the_logical_axis_names_of_the_mesh_rules():
    section, _, _ = _template()
    line = next(par for par in section.split("\n- ") if par.startswith("Logical axis names"))
    listed = set(re.findall(r"`(\w+)`", line)) - {"MeshConfig"}
    assert listed == {name for name, _ in MeshConfig().rules}

"""Opening a downloaded run folder or Hugging Face folder runs no code from it: a module named in a run's
config.json (``mixer_modules``) is imported only when the user names it (``--mixer-module`` or
``HYBRID_LM_MIXER_MODULES``), and the refusal says how, in one line."""

import json
import os
import subprocess
import sys

from hybrid_lm.config import CONFIGS_DIR
from hybrid_lm.experiment import config_record, load_config, run_id

MARK = "imported.txt"


def _downloaded_run(tmp_path):
    """A run folder whose config.json lists a mixer module shipped beside it (it leaves a mark when imported)."""
    run = tmp_path / "downloaded"
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config([str(CONFIGS_DIR / "quickstart.gin")])
    (run / "config.json").write_text(json.dumps({**config_record(cfg), "run_id": run_id(cfg),
                                                 "mixer_modules": ["shipped_mixer"]}, default=str))
    (run / "shipped_mixer.py").write_text(f"open({str(run / MARK)!r}, 'w').close()\n")
    return run


def _cli(run, *args, env=None):
    # `python -m` puts the current directory first on sys.path: the folder's own module would import
    return subprocess.run([sys.executable, "-m", "hybrid_lm.cli", *args], cwd=run, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}, timeout=300)


def test_a_run_folder_s_mixer_module_is_not_imported_unless_named(tmp_path):
    run = _downloaded_run(tmp_path)
    out = _cli(run, "eval", ".", "--no-record")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr[-2000:]
    assert "'shipped_mixer'" in err[0] and "--mixer-module shipped_mixer" in err[0]
    assert "HYBRID_LM_MIXER_MODULES=shipped_mixer" in err[0]
    assert not (run / MARK).exists()
    # named by the user: imported (the run then fails further on, it has no checkpoint)
    out = _cli(run, "--mixer-module", "shipped_mixer", "eval", ".", "--no-record")
    assert (run / MARK).exists(), out.stderr[-2000:]
    (run / MARK).unlink()
    _cli(run, "eval", ".", "--no-record", env={"HYBRID_LM_MIXER_MODULES": "other,shipped_mixer"})
    assert (run / MARK).exists()

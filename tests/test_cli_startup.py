"""``hybrid-lm``'s start-up: the top-level parser imports no command module; the named command's group is
registered in full, with the help the top level lists for it."""

import argparse
import importlib
import subprocess
import sys

import pytest

from hybrid_lm import cli


def test_help_imports_no_command_module_and_no_jax():
    code = ("import sys\nfrom hybrid_lm.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'numpy', 'orbax')"
            " or (m.startswith('hybrid_lm.') and m != 'hybrid_lm.cli')]\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "claims" in r.stdout and "generate" in r.stdout


@pytest.mark.parametrize("module,register,helps", cli.COMMANDS, ids=[m for m, _, _ in cli.COMMANDS])
def test_the_listed_help_is_the_registered_help(module, register, helps):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    getattr(importlib.import_module(module), register)(sub)
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert registered == helps


def test_the_named_command_gets_its_full_parser():
    args = cli.parser("collect").parse_args(["collect", "runs/x", "--out", "t.csv"])
    assert args.cmd == "collect" and args.out == "t.csv" and callable(args.fn)
    args = cli.parser("info").parse_args(["--debug", "info", "a.gin", "--json"])
    assert args.debug and args.json and args.config == ["a.gin"]
    with pytest.raises(SystemExit):  # a command of a group not loaded has no options of its own
        cli.parser("info").parse_args(["collect", "runs/x", "--out", "t.csv"])

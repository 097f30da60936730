"""``hybrid-lm eval``'s suite options are generated from EvalRequest's fields, and the request is built
from the parsed options (hybrid_lm/eval/cli.py ``add_request_options``, ``request_from_args``)."""

from __future__ import annotations

import argparse

import pytest

from hybrid_lm.errors import ConfigError
from hybrid_lm.eval.cli import add_eval_commands, request_from_args
from hybrid_lm.eval.suite import TASKS, EvalRequest, config_option, options


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_eval_commands(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["eval", "RUN", *argv])


def test_no_option_given_is_the_default_request():
    assert request_from_args(_parse()) == EvalRequest()
    assert request_from_args(_parse("--json")) == EvalRequest(progress=False)


def test_each_option_sets_its_field():
    args = _parse("--tasks", "ruler, probe", "--swap", "full=sa:8", "--swap", "efficient=swa:4", "--horizon", "16",
                  "--sinks", "2", "--seq_len", "64", "--eval-windows", "3", "--attention-impl", "xla", "--data", "S",
                  "--samples", "40", "--seed", "3", "--batch-size", "2", "--evaluator", "self", "--evaluator-step", "5",
                  "--longppl-length", "100", "--longppl-min-tokens", "10", "--longppl-inputs", "windows", "--docs", "3",
                  "--trunc-len", "8", "--window", "4", "--ruler-tasks", "niah_single,vt", "--ruler-lengths", "1K,2048",
                  "--haystack", "noise", "--allow-longer", "--swap-prefill-only", "--ruler-no-generation",
                  "--probe-prompt", "exact", "--reference-step", "7", "--influence-inputs", "windows",
                  "--lm-eval-tasks", "a,b", "--lm-eval-limit", "9", "--num-fewshot", "0", "--lm-eval-include", "D")
    want = EvalRequest(
        tasks=("ruler", "probe"), swaps=("full=sa:8", "efficient=swa:4"), horizon=16, sinks=2, seq_len=64,
        eval_windows=3, attention_impl="xla", data="S", samples=40, seed=3, batch_size=2, evaluator="self",
        evaluator_step=5, longppl_length=100, longppl_min_tokens=10, longppl_inputs="windows", longppl_docs=3,
        trunc_len=8, window=4, ruler_tasks=("niah_single", "vt"), ruler_lengths=(1024, 2048), haystack="noise",
        allow_longer=True, swap_prefill_only=True, ruler_generation=False, probe_prompt="exact", reference_step=7,
        influence_inputs="windows", lm_eval_tasks=("a", "b"), lm_eval_limit=9, lm_eval_fewshot=0,
        lm_eval_include="D")
    assert request_from_args(args) == want
    given = {f.name for f, _ in options()}
    assert {f for f in given if getattr(want, f) == getattr(EvalRequest(), f)} == set()  # every option was tried


def test_an_option_that_does_not_parse_is_one_config_error():
    with pytest.raises(ConfigError, match=r"^--ruler-lengths: 'abc' is not a positive length"):
        request_from_args(_parse("--tasks", "ruler", "--ruler-lengths", "abc"))


def test_a_value_outside_an_options_choices_is_refused_by_its_flag():
    with pytest.raises(ConfigError, match=r"^--probe-prompt loose: choose one of official, exact$"):
        EvalRequest(tasks=("probe",), probe_prompt="loose").check()
    with pytest.raises(SystemExit):  # the command line refuses it first (argparse's choices)
        _parse("--probe-prompt", "loose")


def test_every_eval_config_setting_names_the_option_that_sets_it():
    fixed = {"generator", "definition", "alpha", "beta"}  # set by the suite, or by no option of `hybrid-lm eval`
    for task in TASKS:
        conf = EvalRequest(tasks=(task,), swap_prefill_only=True, ruler_generation=False).config(task)
        for key in conf:
            opt = config_option(task, key)
            assert (opt is None) == (key in fixed), (task, key)
    assert config_option("lm_eval", "tasks").flags == ("--lm-eval-tasks",)
    assert config_option("influence", "inputs").flags == ("--influence-inputs",)

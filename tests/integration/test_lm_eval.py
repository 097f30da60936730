"""The ``hybrid_lm`` lm-eval model (hybrid_lm/eval/lm_eval_model.py) against direct computation.

Expected values come from the restored model's logits over each whole sequence (no padding, no
batching, one sequence at a time) and from ``hybrid_lm.eval.generate``; lm-eval runs offline on tiny
local-JSON tasks written to tmp_path (multiple choice, rolling log-likelihood, generate_until).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # no network: the tasks' data are local JSON files
os.environ["HF_HUB_OFFLINE"] = "1"

LL = "loglikelihood"


@pytest.fixture(scope="module", autouse=True)
def _datasets_cache(tmp_path_factory):
    """The tasks' prepared datasets go to a temp dir, not ~/.cache/huggingface."""
    path = tmp_path_factory.mktemp("hf_datasets")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(path))
        if "datasets.config" in sys.modules:  # imported by an earlier test: its cache dir is read at import
            mp.setattr(sys.modules["datasets.config"], "HF_DATASETS_CACHE", path)
        yield path


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    return tiny_run(5)  # TINY, 5 steps (conftest.py)


@pytest.fixture(scope="module")
def lm(run_dir):
    from hybrid_lm.eval.lm_eval_model import model_class
    # as lm-eval builds it: model_args win over its --batch_size (default 1)
    lm = model_class().create_from_arg_string(f"run={run_dir},batch_size=8,progress=false",
                                             {"batch_size": 1, "max_batch_size": None, "device": None})
    assert lm.batch_size == 8 and lm.progress is False and lm.run.step == 5
    return lm


def _req(kind, *args):
    from lm_eval.api.instance import Instance
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


@functools.cache
def _forward(lm):
    """Jitted ``(params, tokens [1, T]) -> (log-probs [T, V], argmax over the tokenizer's ids [T])``,
    eval mode, no padding: one compile per length."""
    import jax
    import jax.numpy as jnp

    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    def forward(params, x):
        ctx = MixerContext(positions=default_positions(*x.shape), seed=lm.cfg.train.seed, train=False)
        logits = lm.calls.fns.model(params)(x, ctx)[0]
        return jax.nn.log_softmax(logits, -1), jnp.argmax(logits[:, :lm.tokenizer.vocab_size], -1)
    return jax.jit(forward)


def direct(lm, tokens, params=None):
    """log p(tokens[k] | tokens[:k]) for k >= 1, and whether each is the argmax: one unpadded forward."""
    tokens = np.asarray(tokens, np.int32)
    logp, best = _forward(lm)(lm.run.params if params is None else params, tokens[None, :-1])
    logp, best = np.asarray(logp, np.float64), np.asarray(best)
    return logp[np.arange(len(tokens) - 1), tokens[1:]], best == tokens[1:]


def direct_ll(lm, context: str, continuation: str) -> float:
    """The continuation's log-likelihood given the context (empty context: the separator token), the
    sequence cut from the left to max_length + 1 tokens."""
    ctx = lm.tok_encode(context) if context else [lm.prefix_token_id]
    cont = lm.tok_encode(continuation)
    return float(direct(lm, (ctx + cont)[-(lm.max_length + 1):])[0][-len(cont):].sum())


# ----------------------------------------------------------------------------- without a model


def test_buckets_and_arguments():
    from hybrid_lm.eval.lm_eval_calls import bucket_down, bucket_up, length_buckets
    from hybrid_lm.eval.lm_eval_model import lm_eval_argv, parse_swaps

    assert length_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert length_buckets(32) == [16, 24, 32] and length_buckets(8) == [8]
    assert bucket_up(17, length_buckets(100)) == 24 and bucket_down(23, [1, 2, 4, 8, 16, 24]) == 16
    assert parse_swaps("full=swa:128; efficient=sa:64") == ["full=swa:128", "efficient=sa:64"]
    assert parse_swaps(["full=swa:8"]) == ["full=swa:8"] and parse_swaps(None) == []
    assert lm_eval_argv(["--tasks", "x"]) == ["run", "--model", "hybrid_lm", "--tasks", "x"]
    assert lm_eval_argv(["run", "--model", "hf"]) == ["run", "--model", "hf"]
    assert lm_eval_argv(["ls", "tasks"]) == ["ls", "tasks"]


def test_lazy_import_without_lm_eval():
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import hybrid_lm.eval.lm_eval_model as m\n"
            "try:\n    m.model_class()\nexcept ImportError as e:\n    print('IMPORT', e)\n"
            "sys.exit(m.main(['--tasks', 'x']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "IMPORT lm_eval is needed" in out.stdout and "pip install -e '.[lm_eval]'" in out.stdout, out
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("lm-eval error: lm_eval is needed"), out


def test_bad_model_args(tmp_path):
    from hybrid_lm.errors import ConfigError, WorkdirError
    from hybrid_lm.eval.lm_eval_model import model_class

    cls = model_class()
    with pytest.raises(ConfigError, match="run=RUN_DIR is required"):
        cls()
    with pytest.raises(ConfigError, match="unknown pretrained"):
        cls(run=str(tmp_path), pretrained="gpt2")
    with pytest.raises(ConfigError, match="batch_size=0"):
        cls(run=str(tmp_path), batch_size=0)
    with pytest.raises(WorkdirError, match="no config.json"):
        cls(run=str(tmp_path))


def test_command_passes_everything_through():
    import argparse

    from hybrid_lm.eval.lm_eval_model import add_lm_eval_command, cmd_lm_eval

    ap = argparse.ArgumentParser()
    add_lm_eval_command(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["lm-eval", "--model_args", "run=r,step=3", "--tasks", "a,b", "--help"])
    assert args.fn is cmd_lm_eval and args.lm_eval_args == ["--model_args", "run=r,step=3", "--tasks", "a,b", "--help"]


# ----------------------------------------------------------------------------- on a trained run


def test_loglikelihood_matches_direct_in_one_padded_batch(lm):
    tok = lm.tokenizer
    long_ctx = "The quick brown fox jumps over the lazy dog. " * 2 + "And"  # > max_length: cut from the left
    pairs = [("The cat", " sat"), ("Once upon a time there", " was a"), ("", "hello"), ("ab ", "cd"),
             ("x", " y"), (long_ctx, " end")]
    before = set(lm.calls.compiled)
    got = lm.loglikelihood([_req(LL, c, x) for c, x in pairs])
    assert len(set(lm.calls.compiled) - before) <= 1  # one padded shape for the whole batch
    assert lm.max_length == 32
    for (c, x), (ll, greedy) in zip(pairs, got):
        # trailing whitespace moves into the continuation, as lm-eval's HF model does
        c2, x2 = c.rstrip(), c[len(c.rstrip()):] + x
        ctx, cont = (lm.tok_encode(c2) if c2 else [lm.prefix_token_id]), lm.tok_encode(x2)
        assert (len(ctx + cont) > 33) == (c == long_ctx)
        logp, best = direct(lm, (ctx + cont)[-33:])
        assert ll == pytest.approx(logp[-len(cont):].sum(), abs=2e-4), (c, x)
        assert greedy == best[-len(cont):].all()
    # a continuation that is the greedy token is reported as greedy
    ids = lm.tok_encode("Once upon a time")
    logp = _next_logp(lm, ids)
    best = int(np.argmax(logp[:tok.vocab_size]))
    assert lm.tok_encode(tok.decode([best])) == [best]  # one token that round-trips
    (ll, greedy), = lm.loglikelihood([_req(LL, "Once upon a time", tok.decode([best]))])
    assert greedy and ll == pytest.approx(logp[best], abs=2e-4)


def test_special_token_strings_in_a_request_are_their_ids(lm, tmp_path):
    """As lm-eval's HF backend's transformers tokenizer encodes a request: "<|endoftext|>" is the EOS id
    (the run's training data keeps it text)."""
    import copy

    from hybrid_lm.data.sources import embedded_documents
    from hybrid_lm.data.tokenizer import load_tokenizer, train_bpe

    text = "\n\n".join(t for _, t in embedded_documents())[:6000]
    train_bpe((text[i:i + 500] for i in range(0, len(text), 500)), 300, tmp_path)
    tok = load_tokenizer(str(tmp_path))
    bpe = copy.copy(lm)
    bpe.tokenizer = tok
    request = "The end.<|endoftext|>A new"
    assert bpe.tok_encode(request) == [*map(int, tok.encode("The end.")), tok.eos_id, *map(int, tok.encode("A new"))]
    assert tok.eos_id not in tok.encode(request)


def _next_logp(lm, ids):
    """log p(next token | ids) over the vocabulary."""
    return np.asarray(_forward(lm)(lm.run.params, np.asarray(ids, np.int32)[None])[0][-1], np.float64)


def test_rolling_loglikelihood_short_and_windowed(lm):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    short, long = "a short text", "Rolling windows cover every token once, each with context. " * 2
    assert len(lm.tok_encode(short)) < lm.max_length < len(lm.tok_encode(long))
    got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", short), _req("loglikelihood_rolling", long)])
    ids = lm.tok_encode(short)
    assert got[0] == pytest.approx(direct(lm, [lm.prefix_token_id] + ids)[0].sum(), abs=2e-4)
    ids = lm.tok_encode(long)
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(ids, lm.prefix_token_id, lm.max_length, 1)]
    assert len(windows) == 4 and sum((cont for _, cont in windows), []) == ids  # each token predicted once
    want = 0.0
    for ctx, cont in windows:
        assert len(ctx) + len(cont) <= lm.max_length + 1
        want += direct(lm, ctx + cont)[0][-len(cont):].sum()
    assert got[1] == pytest.approx(want, abs=5e-4)


def test_swap_is_applied(lm, run_dir):
    from hybrid_lm.errors import ConfigError
    from hybrid_lm.eval.lm_eval_model import model_class

    with pytest.raises(ConfigError, match="unknown mixer kind .nope."):
        model_class()(run=str(run_dir), swap="full=nope:4")
    swapped = model_class()(run=str(run_dir), swap="full=swa:4", batch_size=8, progress=False)
    assert swapped.cfg.model.full.kind == "swa" and swapped.cfg.model.full.window == 4
    pair = ("Once upon a time there", " was a")
    (ll, _), = swapped.loglikelihood([_req(LL, *pair)])
    assert ll == pytest.approx(direct_ll(swapped, *pair), abs=2e-4)
    assert abs(ll - direct_ll(lm, *pair)) > 1e-3  # the full-attention layer now sees 4 tokens


def test_swap_prefill_only_scores_continuations_over_the_swapped_context(lm, run_dir):
    """``swap_prefill_only``: each request equals prefill_swap's split scoring of its own unpadded
    sequence (SA's permutation is drawn over exactly the context, so requests are grouped by context
    length and only the continuation is padded); plain swapped scoring differs."""
    from hybrid_lm.errors import ConfigError
    from hybrid_lm.eval.lm_eval_calls import request_id
    from hybrid_lm.eval.lm_eval_model import model_class
    from hybrid_lm.eval.prefill_swap import split_answer_nll_fn

    with pytest.raises(ConfigError, match="swap_prefill_only needs swap="):
        model_class()(run=str(run_dir), swap_prefill_only="true")
    m = model_class()(run=str(run_dir), swap="full=sa:4", swap_prefill_only="true", batch_size=4, progress=False)
    pairs = [("Once upon a time there", " was a"), ("Once upon a time there", " were"),
             ("The essays of the year", " are long"), ("A", " b"), ("Once upon a time there", " was a")]
    got = m.loglikelihood([_req(LL, *p) for p in pairs])
    assert got[4] == got[0]  # a context's SA permutation follows its tokens, not its row in the batch
    for (context, continuation), (ll, greedy) in zip(pairs, got):
        ctx, cont = m.tok_encode(context), m.tok_encode(continuation)
        c = m.calls
        nll, best = split_answer_nll_fn(c.answer_fns, c.fns, c.answer_cfg, c.cfg, len(cont), vocab=c.vocab)(
            m.run.params, np.asarray([ctx + cont], np.int32), np.asarray([request_id(ctx)], np.int32))
        assert ll == pytest.approx(-float(np.asarray(nll).sum()), rel=5e-5)  # batched and padded: float32 order
        assert greedy == bool(np.asarray(best).all())
    plain = model_class()(run=str(run_dir), swap="full=sa:4", batch_size=4, progress=False)
    assert abs(got[0][0] - plain.loglikelihood([_req(LL, *pairs[0])])[0][0]) > 1e-3
    assert m.get_model_info()["hybrid_lm_swap_prefill_only"] is True
    with pytest.raises(ConfigError, match="this task asks for loglikelihood_rolling"):
        m.loglikelihood_rolling([_req("loglikelihood_rolling", "some text")])
    with pytest.raises(ConfigError, match="cutting the context would change what is prefilled"):
        m.loglikelihood([_req(LL, "x" * 40, " y")])  # 40 + 2 tokens > max_length 32 + 1


@pytest.fixture
def random_params(lm):
    """The restored parameters plus noise: greedy outputs that depend on the prompt (five training
    steps leave a near-unigram model)."""
    import jax

    saved = lm.run.params
    rng = np.random.default_rng(7)
    noisy = jax.tree.map(lambda x: np.asarray(x) + 0.5 * rng.standard_normal(x.shape).astype(x.dtype), saved)
    lm.run.params = jax.device_put(noisy, lm.run.p_shard)
    yield lm.run.params
    lm.run.params = saved


def test_generate_until_matches_generate(lm, random_params):
    from hybrid_lm.errors import ConfigError
    from hybrid_lm.eval.generate import generate

    budget = 8
    max_ctx = lm.max_length - budget
    prompts = ["Once upon a time there", "The", "A prompt longer than the room left for it is cut from the left"]
    model = lm.calls.fns.model(random_params)
    full = []
    for p in prompts:
        ids = lm.tok_encode(p)[-max_ctx:]
        out = generate(model, np.asarray(ids)[None], budget, vocab_limit=lm.tokenizer.vocab_size)
        full.append(lm.tok_decode(np.asarray(out[0])))
    assert len(set(full)) == len(full), full  # the prompts matter
    never = {"until": ["\x00never"], "max_gen_toks": budget, "do_sample": False}
    before = set(lm.calls.compiled)
    assert lm.generate_until([_req("generate_until", p, never) for p in prompts]) == full
    assert {k for k, _ in set(lm.calls.compiled) - before} <= {"prefill", "decode"} and len(set(lm.calls.compiled) - before) <= 2
    # stop strings: the first ASCII character that is not the first one of a continuation
    text = next(t for t in full if any(ch.isascii() and t.index(ch) > 0 for ch in t))
    stop = next(ch for ch in text if ch.isascii() and text.index(ch) > 0)
    kw = {"until": [stop], "max_gen_toks": budget}
    got = lm.generate_until([_req("generate_until", p, kw) for p in prompts])
    assert got == [t.split(stop)[0] for t in full]
    assert got[full.index(text)] == text[:text.index(stop)] != text
    with pytest.raises(ConfigError, match="greedily only"):
        lm.generate_until([_req("generate_until", "x", {"until": [], "do_sample": True, "temperature": 1.0})])
    with pytest.raises(ConfigError, match="leaves no room"):
        lm.generate_until([_req("generate_until", "x", {"until": [], "max_gen_toks": 32})])


# ----------------------------------------------------------------------------- through lm-eval


MC_DOCS = [{"question": "The cat sat", "choices": ["on the mat", "in the big sky"]},  # few distinct lengths:
           {"question": "Once upon a", "choices": ["time", "dogs", "tree"]},  # one compile each
           {"question": "Two and two", "choices": ["four", "five"]}]
ROLL_DOCS = [{"text": "A short document."},
             {"text": "A longer document that needs more than one window of thirty-two bytes to be scored."}]
GEN_DOCS = [{"prompt": "Once upon a time"}, {"prompt": "The cat sat on a"}]


def _write_tasks(root, mc_gold, gen_targets):
    """Three tiny tasks on local JSON files under ``root``."""
    tasks = {
        "tiny_mc": ([dict(d, label=g) for d, g in zip(MC_DOCS, mc_gold)],
                    "output_type: multiple_choice\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
                    "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                    "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "tiny_roll": (ROLL_DOCS, "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                      "metric_list:\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"),
        "tiny_gen": ([dict(d, target=t) for d, t in zip(GEN_DOCS, gen_targets)],
                     "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{target}}\"\n"
                     "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
                     "metric_list:\n  - metric: exact_match\n"),
    }
    root.mkdir(parents=True, exist_ok=True)
    for name, (docs, spec) in tasks.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                           f"    test: {data}\ntest_split: test\n{spec}")


def _expected(lm):
    """Per-doc choice log-likelihoods, rolling log-likelihoods and greedy outputs, computed directly."""
    from hybrid_lm.eval.generate import generate

    mc = [[direct_ll(lm, f"Q: {d['question']}\nA:", " " + c) for c in d["choices"]] for d in MC_DOCS]
    roll = [float(direct(lm, [lm.prefix_token_id] + lm.tok_encode(d["text"]))[0].sum()) if
            len(lm.tok_encode(d["text"])) <= lm.max_length else None for d in ROLL_DOCS]
    model = lm.run.model()  # one model object: one compiled generate per prompt length
    gen = [lm.tok_decode(np.asarray(generate(model, np.asarray(lm.tok_encode(d["prompt"]))[None], 8,
                                             vocab_limit=lm.tokenizer.vocab_size))[0]).split("\n")[0] for d in GEN_DOCS]
    return mc, roll, gen


def test_simple_evaluate_tiny_tasks(lm, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    mc, roll, gen = _expected(lm)
    best = [int(np.argmax(s)) for s in mc]
    gold = [best[0], int(np.argmin(mc[1])), 0]  # right, wrong, whatever the model says
    _write_tasks(tmp_path / "tasks", gold, [gen[0], gen[1] + "#"])  # doc 0 matches, doc 1 cannot
    tm = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_roll", "tiny_gen"], task_manager=tm,
                                  log_samples=True, bootstrap_iters=0)
    res, samples = out["results"], out["samples"]
    # multiple choice: each choice's log-likelihood, then acc / acc_norm (per character of the choice)
    for s in samples["tiny_mc"]:
        d = s["doc_id"]
        assert [r[0][0] for r in s["resps"]] == pytest.approx(mc[d], abs=2e-4)
    norm = [int(np.argmax([ll / len(c) for ll, c in zip(s, d["choices"])])) for s, d in zip(mc, MC_DOCS)]
    assert res["tiny_mc"]["acc,none"] == pytest.approx(np.mean([b == g for b, g in zip(best, gold)]))
    assert res["tiny_mc"]["acc_norm,none"] == pytest.approx(np.mean([b == g for b, g in zip(norm, gold)]))
    # rolling: the short document directly; bits/byte over both from lm-eval's per-doc values
    rolled = {s["doc_id"]: s["resps"][0][0] for s in samples["tiny_roll"]}
    assert rolled[0] == pytest.approx(roll[0], abs=2e-4)
    assert rolled[1] == pytest.approx(lm.loglikelihood_rolling([_req("loglikelihood_rolling", ROLL_DOCS[1]["text"])])[0],
                                      abs=1e-6)
    n_bytes = sum(len(d["text"].encode()) for d in ROLL_DOCS)
    bpb = -sum(rolled.values()) / n_bytes / math.log(2)
    assert res["tiny_roll"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-6)
    assert res["tiny_roll"]["byte_perplexity,none"] == pytest.approx(2 ** bpb, rel=1e-6)
    # generation: the greedy outputs of hybrid_lm.eval.generate, cut at "\n"
    assert sorted((s["doc_id"], s["resps"][0][0]) for s in samples["tiny_gen"]) == list(enumerate(gen))
    assert res["tiny_gen"]["exact_match,none"] == pytest.approx(0.5)
    assert out["config"]["hybrid_lm_step"] == 5 and out["config"]["hybrid_lm_max_length"] == 32


def test_lm_eval_command_line(lm, run_dir, tmp_path, monkeypatch, capsys):
    """``python -m hybrid_lm.eval.lm_eval_model`` = lm-eval's CLI with the model registered; the task
    index is limited to the included tasks (indexing lm-eval's ~14k task files takes a minute here)."""
    import functools

    import lm_eval.tasks
    from hybrid_lm.eval.lm_eval_model import main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                         include_defaults=False))
    _write_tasks(tmp_path / "tasks", [0, 0, 0], ["a", "b"])
    rc = main(["--model_args", f"run={run_dir},step=5,progress=false", "--batch_size", "4", "--tasks", "tiny_mc",
               "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")])
    assert rc == 0
    assert "tiny_mc" in capsys.readouterr().out
    (path,) = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(path.read_text())
    assert result["config"]["model"] == "hybrid_lm" and result["config"]["hybrid_lm_step"] == 5
    best = [int(np.argmax([direct_ll(lm, f"Q: {d['question']}\nA:", " " + c) for c in d["choices"]])) for d in MC_DOCS]
    assert result["results"]["tiny_mc"]["acc,none"] == pytest.approx(np.mean([b == 0 for b in best]))
    # a bad model_args is one line, exit 2
    assert main(["--model_args", f"run={run_dir},colour=red", "--tasks", "tiny_mc",
                 "--include_path", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lm-eval error: hybrid_lm model_args: unknown colour")


def test_eval_suite_task_lm_eval(lm, run_dir, tmp_path, capsys):
    """``hybrid-lm eval RUN --tasks lm_eval``: a row per lm-eval task with the suite's common fields;
    its score is lm-eval's acc_norm computed from the checkpoint's own log-likelihoods."""
    from hybrid_lm.cli import main
    from hybrid_lm.eval.suite import current_rows

    mc, _, _ = _expected(lm)
    gold = [int(np.argmax(mc[0])), int(np.argmin(mc[1])), 0]
    _write_tasks(tmp_path / "tasks", gold, ["x", "y"])
    assert main(["eval", str(run_dir), "--tasks", "lm_eval", "--lm-eval-tasks", "tiny_mc",
                 "--lm-eval-include", str(tmp_path / "tasks"), "--batch-size", "8"]) == 0
    assert "lm_eval/tiny_mc" in capsys.readouterr().out
    row = next(r for r in current_rows(run_dir) if r.get("task") == "lm_eval/tiny_mc")
    norm = [int(np.argmax([ll / len(c) for ll, c in zip(s, d["choices"])])) for s, d in zip(mc, MC_DOCS)]
    assert row["score_metric"] == "acc_norm,none"
    assert row["score"] == pytest.approx(np.mean([b == g for b, g in zip(norm, gold)]))
    assert row["checkpoint_step"] == 5 and row["tokens_seen"] == 5 * 128 and row["eval_config"]["tasks"] == ["tiny_mc"]


def test_next_line_task_under_the_papers_protocol(lm, run_dir, tmp_path, capsys):
    """`data next-line-task` on the embedded store (contexts of 12 tokens and lines of at most 19 characters,
    for a run of 32 tokens): every context re-encodes to exactly C tokens; then `eval --tasks lm_eval --swap full=sa:4 --swap-prefill-only` scores
    each choice as prefill_swap does (context through the swap, choice through the run's own layers), and
    its acc is the share of items whose gold choice scores highest."""
    from hybrid_lm.cli import main
    from hybrid_lm.data.corpus import ensure_store
    from hybrid_lm.eval.lm_eval_model import model_class
    from hybrid_lm.eval.suite import current_rows

    store, out = ensure_store("embedded", None, "byte"), tmp_path / "nl"
    for bad, msg in ((["--items", "0"], "--items 0: must be an integer >= 1"),
                     (["--choices", "1"], "--choices 1: must be an integer >= 2"),
                     (["--items", "100000"], "items of 100000 (4 documents of at least 20 tokens)")):
        assert main(["data", "next-line-task", "--store", str(store), "--tokenizer", "byte", "--out", str(out),
                     "--context-tokens", "12", "--max-line-chars", "19", *bad]) == 2
        assert msg in capsys.readouterr().err
    assert main(["data", "next-line-task", "--store", str(store), "--tokenizer", "byte", "--out", str(out),
                 "--items", "4", "--context-tokens", "12", "--max-line-chars", "19"]) == 0
    items = [json.loads(x) for x in (out / "next_line.jsonl").read_text().splitlines()]
    assert len(items) == 4 and all(len(lm.tok_encode(it["context"])) == 12 for it in items)
    assert all(len(it["choices"]) == 4 and all(c.startswith("\n") for c in it["choices"]) for it in items)
    assert all(not it["context"][-1].isspace() for it in items)

    rc = main(["eval", str(run_dir), "--tasks", "lm_eval", "--lm-eval-include", str(out), "--lm-eval-tasks",
               "next_line", "--swap", "full=sa:4", "--swap-prefill-only", "--batch-size", "8", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    (row,) = [r for r in current_rows(run_dir) if r.get("task") == "lm_eval/next_line"]
    assert row["eval_config"]["swap_prefill_only"] is True and row["answer_scoring"].startswith("prefill with")
    m = model_class()(run=str(run_dir), swap="full=sa:4", swap_prefill_only="true", batch_size=8, progress=False)
    scores = [[ll for ll, _ in m.loglikelihood([_req(LL, it["context"], c) for c in it["choices"]])] for it in items]
    acc = np.mean([int(np.argmax(s)) == it["label"] for s, it in zip(scores, items)])
    assert row["metrics"]["acc,none"] == pytest.approx(acc)

"""Parity with transformers, both ways, in fp32, and lm-eval's HF backend on an exported model.

For each family (``tests/hf_families.py``: Llama all-full GQA untied and MQA tied; Ministral full + SWA;
Mistral all-SWA; Qwen3 q/k norm + SWA; SmolLM3 NoPE layers, with and without SWA):

- export: a random hybrid_lm model written by ``hybrid_lm.run.hf.write_hf_folder`` (what ``hybrid-lm
  export --format hf`` writes), loaded by ``AutoModelForCausalLM.from_pretrained`` with eager and sdpa
  attention: transformers' logits against hybrid_lm's;
- import: a random transformers model of the family's config class, ``save_pretrained``, restored by
  hybrid_lm as ``hf:DIR`` (``RestoredRun``, the loader of eval / generate / longppl / ruler): hybrid_lm's
  logits against transformers' (eager and sdpa).

The error is max |ours - theirs| / max |theirs| over the logits of 2 x 24 random tokens (windows of 5),
which must stay below 1e-4. Then lm-eval: the log-likelihoods of a few local task items by lm-eval's HF
backend (``HFLM``) on an exported model with a BPE tokenizer, against hybrid_lm's lm-eval model on the
same folder (the path of ``hybrid-lm eval --tasks lm_eval``). Where ``HFLM`` does not import (it needs
accelerate), the HF side is computed as ``HFLM._loglikelihood_tokens`` does (lm_eval/models/huggingface.py,
0.4.13: the context + continuation truncated to max_length + 1, the last token dropped, log_softmax, the
continuation's log-probs summed, greedy = every continuation token the argmax); the line says which.

It needs torch and transformers, not a GPU (torch runs on the CPU; ``HF_PARITY_TORCH_DEVICE=cuda`` moves
it). On a GPU, with the wheels in .whl installed (``experiments/gpu.sh`` does it)::

    JAX_PLATFORMS=cuda,cpu JAX_DISABLE_MOST_OPTIMIZATIONS=0 PYTHONPATH=/tmp/site:$PWD \\
        python -m pytest -q -s -m gpu tests/gpu/test_gpu_hf_parity.py

Each result is one printed line (and, when ``$OUT`` is set, a line of ``$OUT/hf_parity.txt``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from hf_families import HF_BASE, OURS, THEIRS, layer_summary, logits, random_params, tiny_model

pytestmark = [pytest.mark.gpu]
torch = transformers = None  # imported by _torch_and_transformers: a CPU suite without them collects this file


@pytest.fixture(scope="module", autouse=True)
def _torch_and_transformers():
    global torch, transformers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: nothing is downloaded
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

REL = 1e-4
T = 24
IMPLS = ("eager", "sdpa")
DEVICE = os.environ.get("HF_PARITY_TORCH_DEVICE", "cpu")


def report(line: str) -> None:
    import jax

    line = f"transformers {transformers.__version__}  torch {torch.__version__} ({DEVICE})  jax {jax.__version__} " \
           f"({jax.default_backend()})  {line}"
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hf_parity.txt"), "a") as fh:
            fh.write(line + "\n")


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, T)).astype(np.int32)


def hf_logits(folder, impl: str, toks) -> tuple[np.ndarray, str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=impl)
    model = model.to(DEVICE).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(toks, dtype=torch.long, device=DEVICE)).logits
    return out.float().cpu().numpy(), type(model).__name__


@pytest.mark.parametrize("name", list(OURS))
def test_export_parity(tmp_path, name):
    """hybrid_lm -> transformers: an exported random model's logits in transformers equal hybrid_lm's."""
    from hybrid_lm.run.hf import ARCHITECTURES, write_hf_folder

    family = OURS[name][0]
    model = tiny_model(name)
    params = random_params(model, seed=1)
    record = {"model": dataclasses.asdict(model), "data": {"tokenizer": "byte", "seq_len": 64}}
    cfg = write_hf_folder(tmp_path, model, params, tokenizer="byte", seq_len=64, record=record)
    assert cfg["model_type"] == family
    toks = tokens(model.vocab_size)
    ours = logits(model, params, toks)
    for impl in IMPLS:
        theirs, arch = hf_logits(tmp_path, impl, toks)
        assert arch == ARCHITECTURES[family]
        err = rel_err(ours, theirs)
        report(f"{name:<12} {family:<9} export (hybrid_lm -> transformers) {impl:<5} rel err {err:.2e}")
        assert err < REL, (name, impl, err)


def _random_transformers_model(model_type: str, kw: dict, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**HF_BASE, **kw})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # not the init's ones and zeros: every weight random
        for pname, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "embed_tokens" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 / p.shape[1] ** 0.5)
    return model


@pytest.mark.parametrize("name", list(THEIRS))
def test_import_parity(tmp_path, name):
    """transformers -> hybrid_lm: a saved random transformers model restored as ``hf:DIR`` gives
    transformers' logits."""
    from hybrid_lm.run.restore import RestoredRun

    model_type, kw, types, slots = THEIRS[name]
    _random_transformers_model(model_type, kw, seed=2).save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    run = RestoredRun(f"hf:{tmp_path}")
    model = dataclasses.replace(run.cfg.model, compute_dtype="float32", attention_impl="xla")
    assert layer_summary(model) == (types, slots), saved
    toks = tokens(model.vocab_size, seed=3)
    ours = logits(model, run.params, toks)
    for impl in IMPLS:
        theirs, _ = hf_logits(tmp_path, impl, toks)
        err = rel_err(ours, theirs)
        report(f"{name:<12} {model_type:<9} import (transformers -> hybrid_lm) {impl:<5} rel err {err:.2e}")
        assert err < REL, (name, impl, err)


# ----------------------------------------------------------------------------- lm-eval's HF backend

# local task items (context, continuation): multiple choice as lm-eval asks it, an empty context (the
# prefix token), trailing spaces moved into the continuation, several-token continuations
ITEMS = [("The capital of France is", " Paris"), ("The capital of France is", " Rome"),
         ("The capital of France is", " a small village"), ("Question: what is two plus two?\nAnswer:", " four"),
         ("Question: what is two plus two?\nAnswer:", " five"), ("", "Once upon a time"),
         ("She opened the door and ", "saw the garden."), ("def add(a, b):\n    return", " a + b")]
CORPUS_WORDS = ("the a of and to in is was for on that with as by at from capital city france paris rome "
                "question answer what two plus four five once upon time she opened door saw garden def add "
                "return village small large river mountain").split()


def _bpe(tmp_path):
    from hybrid_lm.data.tokenizer import load_tokenizer, train_bpe

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(CORPUS_WORDS, 60)) + ". " + " ".join(a + b for a, b in ITEMS) for _ in range(200)]
    path = train_bpe(texts, 384, tmp_path / "tok")
    return path, load_tokenizer(str(path))


def _hf_side_direct(folder, requests, max_length: int):
    """HF log-likelihoods computed as lm-eval's HFLM computes them (module docstring), with the
    folder's transformers tokenizer and TemplateLM's pair encoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(DEVICE).eval()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    out = []
    for req in requests:
        context, continuation = req.args
        if context == "":
            cont = enc(continuation)
            ctx, cont = ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
        else:
            n = len(context) - len(context.rstrip())
            if n:
                context, continuation = context[:-n], context[-n:] + continuation
            whole, ctx = enc(context + continuation), enc(context)
            cont = whole[len(ctx):]
        inp = (ctx + cont)[-(max_length + 1):][:-1]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([inp], device=DEVICE)).logits[0].float(), -1)
        logp = logp[len(inp) - len(cont):len(inp)]
        target = torch.tensor(cont, device=DEVICE)
        out.append((float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())))
    return out


def test_lm_eval_hf_backend_matches_ours(tmp_path):
    """lm-eval's HF backend on an exported model gives hybrid_lm's lm-eval log-likelihoods on the same items."""
    try:
        import lm_eval
        from lm_eval.api.instance import Instance
    except ImportError as e:
        report(f"lm-eval: not run, lm_eval does not import ({e}): carry its wheel (and the module named) in .whl")
        pytest.skip(f"lm_eval does not import: {e}")
    from hybrid_lm.run.hf import write_hf_folder
    from hybrid_lm.eval.lm_eval_model import model_class

    tok_path, tok = _bpe(tmp_path)
    model = tiny_model("ministral", vocab_size=tok.vocab_size)  # no padded rows: greedy flags compare over one vocab
    params = random_params(model, seed=4)
    folder = tmp_path / "hf"
    folder.mkdir()
    write_hf_folder(folder, model, params, tokenizer=str(tok_path), seq_len=64,
                    record={"model": dataclasses.asdict(model), "data": {"tokenizer": str(tok_path), "seq_len": 64}})
    from transformers import AutoTokenizer

    theirs_tok = AutoTokenizer.from_pretrained(str(folder))
    for text in {s for pair in ITEMS for s in pair} | {a + b for a, b in ITEMS}:
        assert theirs_tok.encode(text, add_special_tokens=False) == [int(i) for i in tok.encode(text)], text
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(ITEMS)]
    import jax

    with jax.default_matmul_precision("highest"):  # fp32 matmuls, not TF32, as torch's on the CPU
        ours = model_class()(run=f"hf:{folder}", batch_size=4, max_length=64, progress=False).loglikelihood(requests)
    try:
        from lm_eval.models.huggingface import HFLM

        hflm = HFLM(pretrained=str(folder), backend="causal", dtype="float32", device=DEVICE, batch_size=1,
                    max_length=64)
        theirs = hflm.loglikelihood(requests, disable_tqdm=True)
        how = "lm-eval HFLM"
    except Exception as e:  # HFLM missing (accelerate) or refusing: the same computation, done here
        report(f"lm-eval: HFLM not used ({type(e).__name__}: {str(e).splitlines()[0][:160]}); computing as "
               "HFLM._loglikelihood_tokens does")
        theirs = _hf_side_direct(folder, requests, 64)
        how = "direct, as HFLM"
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    scale = max(abs(b[0]) for b in theirs)
    same_greedy = [a[1] for a in ours] == [b[1] for b in theirs]
    report(f"lm-eval {lm_eval.__version__} ({how}): {len(ITEMS)} loglikelihood items, max |ours - theirs| "
           f"{diff:.2e} nats (rel {diff / scale:.2e}), greedy flags equal: {same_greedy}")
    assert diff / scale < REL and same_greedy, (ours, theirs)

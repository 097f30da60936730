"""The evaluation suite's definitions against transcriptions of the official code, on small random inputs.

Each ``official_*`` function below is a line-by-line transcription (PyTorch / HF calls replaced by their
numpy or JAX equivalents, random draws passed in) of the code it names:

- thunlp/rethinking-hybrid-attention at feaad0899bea98e0bf32de9693f37a176713f3ad:
  ``src/gradient/run_gradient_influence.py`` (G(d)), ``src/tracing/find_retrieval_heads.py`` (the
  retrieval score), ``src/tracing/compute_attention_metrics.py`` (H(t)),
  ``src/tracing/compute_weight_distance.py`` (d_QK), ``src/probing/01_prepare_data.py``,
  ``02_extract_hiddenstate.py`` and ``03_train_probing.py`` (the probe);
- NVIDIA/RULER at c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a: ``scripts/data/synthetic/variable_tracking.py``,
  ``niah.py``, ``freq_words_extraction.py``, ``constants.py``, ``scripts/eval/evaluate.py`` and
  ``scripts/eval/synthetic/constants.py``;
- PKU-ML/LongPPL at 1decd2a70d9ee78488adea49c088f8bc472f4938: ``longppl/longppl.py`` and
  ``perplexity/perplexity.py``.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_lm.data.tokenizer import load_tokenizer
from hybrid_lm.eval import introspect as I
from hybrid_lm.eval import ruler as R, ruler_items as RI

BYTE = load_tokenizer("byte")


def _tiny(*extra, layers: int = 2, pattern: str = "F"):
    from conftest import TINY
    from hybrid_lm.experiment import load_config
    from hybrid_lm.step import ModelFns

    cfg = load_config([], list(TINY) + [f"ModelConfig.n_layers = {layers}", f"ModelConfig.layer_pattern = '{pattern}'",
                                        "ModelConfig.n_heads = 4", "ModelConfig.n_kv_heads = 2", *extra])
    fns = ModelFns(cfg)
    return cfg, fns, fns.init(0)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from hybrid_lm.data.tokenizer import train_bpe
    path = train_bpe([text for _, text in RI.essay_texts()[:5]], 512, tmp_path_factory.mktemp("bpe"))
    return load_tokenizer(str(path))


# ----------------------------------------------------------------------------- G(d)


def official_gradient_curve(forward, embeds: list, context_len: int, target_last_n_tokens: int = 20):
    """run_gradient_influence.py _compute_curve_for_model, target "logit_sum" (lines ~195-236): per
    sample, ``logits[:, -n:, :].mean(dim=1).sum()``, the L2 norm of its gradient at every input
    embedding, summed per distance from the last token and divided by the count."""
    sums = np.zeros(context_len, dtype=np.float64)
    counts = np.zeros(context_len, dtype=np.int64)
    for inputs_embeds in embeds:
        def target(e):
            logits = forward(e)
            effective_last_n = min(target_last_n_tokens, int(logits.shape[1]))
            logits = logits[:, -effective_last_n:, :].mean(axis=1)
            return logits.sum()
        grads = jax.grad(target)(inputs_embeds)
        norms = np.asarray(jnp.linalg.norm(grads[0].astype(jnp.float32), ord=2, axis=-1))
        seq_len = int(norms.shape[0])
        for dist in range(seq_len):
            token_idx = seq_len - 1 - dist
            sums[dist] += float(norms[token_idx])
            counts[dist] += 1
    mean_curve = np.full(context_len, np.nan, dtype=np.float64)
    valid = counts > 0
    mean_curve[valid] = sums[valid] / counts[valid]
    return mean_curve


@pytest.mark.integration  # a model's whole eval task
def test_gradient_influence_is_the_official_logit_sum_target():
    from flax import nnx

    from hybrid_lm.eval.influence import _norms_fn
    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    cfg, fns, params = _tiny(layers=2, pattern="1:1")
    model = fns.model(params)
    B, T, last = 3, 24, 5
    tokens = np.random.default_rng(0).integers(0, 256, (B, T)).astype(np.int32)

    def forward(e):
        ctx = MixerContext(positions=default_positions(e.shape[0], T), train=False)
        return model.logits(model.run_blocks(e, ctx))

    embeds = [model.embed(jnp.asarray(tokens[i:i + 1]), jnp.float32) for i in range(B)]
    want = official_gradient_curve(forward, embeds, T, last)
    ours = np.asarray(_norms_fn(model, cfg, last)(nnx.state(model), jnp.asarray(tokens), None)).mean(0)
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=1e-7)
    summed = official_gradient_curve(lambda e: forward(e) * last, embeds, T, last)  # s summed, not averaged
    np.testing.assert_allclose(summed / ours, last, rtol=1e-3)


# ----------------------------------------------------------------------------- retrieval heads


def official_needle_positions(tokenizer, token_list: list[int], needles: list[str]) -> list[int]:
    """find_retrieval_heads.py _find_subsequence + _needle_positions (lines ~82-111)."""
    def _find_subsequence(sequence, pattern):
        if not sequence or not pattern or len(pattern) > len(sequence):
            return []
        span_positions = []
        plen = len(pattern)
        for start in range(0, len(sequence) - plen + 1):
            if sequence[start: start + plen] == pattern:
                span_positions.extend(range(start, start + plen))
        return span_positions

    positions = set()
    for needle in needles:
        for variant in [needle, f" {needle}", f"{needle}.", f" {needle}.", f": {needle}", f": {needle}."]:
            needle_ids = [int(x) for x in tokenizer.encode(variant)]
            if not needle_ids:
                continue
            for pos in _find_subsequence(token_list, needle_ids):
                positions.add(pos)
    return sorted(positions)


def official_head_scores(attentions, input_ids_list, needles_list, tokenizer, query_index_from_end: int = 2):
    """find_retrieval_heads.py main() (lines ~257-332): per sample, the attention of the query at
    ``len - 2`` summed over the needle positions, per (layer, head), averaged over the used samples.
    ``attentions[s]``: ``[layers, heads, T, T]`` of sample s."""
    layer_head_scores, used_samples = None, 0
    for attn, input_ids, needles in zip(attentions, input_ids_list, needles_list):
        needle_pos = official_needle_positions(tokenizer, list(input_ids), needles)
        if not needle_pos:
            continue
        query_index = max(0, len(input_ids) - query_index_from_end)
        query_index = min(query_index, len(input_ids) - 1)
        if layer_head_scores is None:
            layer_head_scores = np.zeros(attn.shape[:2], dtype=np.float64)
        for layer_idx in range(attn.shape[0]):
            score_vec = attn[layer_idx, :, query_index, :]
            layer_head_scores[layer_idx] += score_vec[:, needle_pos].sum(axis=-1)
        used_samples += 1
    return layer_head_scores / used_samples


def official_entropy(attentions, tail_queries: int = 4, eps: float = 1e-12):
    """compute_attention_metrics.py _compute_for_checkpoint (lines ~306-336): per (layer, head), the
    mean over samples and the last ``tail_queries`` queries of the entropy of ``attn[q, :q + 1]``
    renormalised by ``sum + eps``, clamped at eps, divided by ``log(q + 1)``."""
    per = {}
    for attn in attentions:
        seq_len = attn.shape[-1]
        start_query = max(0, seq_len - tail_queries)
        for layer_idx in range(attn.shape[0]):
            for head_idx in range(attn.shape[1]):
                for query_idx in range(start_query, seq_len):
                    probs = attn[layer_idx, head_idx, query_idx, : query_idx + 1].astype(np.float64)
                    probs = probs / (probs.sum() + eps)
                    probs = np.clip(probs, eps, None)
                    entropy = -(probs * np.log(probs)).sum()
                    per.setdefault((layer_idx, head_idx), []).append(entropy / float(np.log(len(probs))))
    return {k: float(np.mean(v)) for k, v in per.items()}


def _attention_items(tok, n: int, T: int, seed: int):
    """Random token prompts of T ids, each hiding an answer number (two of them in item 0) after ': '."""
    rng = np.random.default_rng(seed)
    ids, answers = [], []
    for i in range(n):
        value = str(31415920 + i % 8)
        body = tok.decode(rng.integers(97, 123, T))  # lower-case letters
        text = body[:T // 3] + f" is: {value}." + body[T // 3:]
        if i == 0:
            text = text[:10] + value + text[10:]
        row = np.asarray(tok.encode(text), np.int32)[:T]
        ids.append(row)
        answers.append([value])
    return np.stack(ids), answers


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_answer_positions_are_the_official_needle_positions(tokenizer, bpe):
    tok = BYTE if tokenizer == "byte" else bpe
    ids, answers = _attention_items(tok, 6, 80, 1)
    for row, ans in zip(ids, answers):
        want = official_needle_positions(tok, [int(x) for x in row], ans)
        assert I.answer_positions(tok, row, ans).tolist() == want
    assert I.answer_positions(tok, ids[0], ["99999999"]).size == 0


def _all_attentions(cfg, fns, params, tokens):
    """``[B, layers, heads, T, T]``: every query's attention in every full-attention layer (what HF's
    ``output_attentions`` returns), from ``introspect.head_attention``."""
    def run(params, tokens):
        model = fns.model(params)
        B, T = tokens.shape
        ctx = I.eval_context(cfg, B, T)
        out = []

        def visit(i, block, x):
            qpos = jnp.broadcast_to(jnp.arange(T), (B, T))
            out.append(I.head_attention(block, x, ctx.positions, qpos))
        I.run_layers(model, tokens, ctx, on_block=visit)
        return jnp.stack(out, 1)
    return np.asarray(jax.jit(run)(params, tokens))


def test_retrieval_score_and_entropy_are_the_official_ones():
    cfg, fns, params = _tiny(layers=2, pattern="F")
    mixer = params["blocks"][1]["mixer"]
    mixer["wq"], mixer["wk"] = mixer["wq"] * 6.0, mixer["wk"] * 6.0  # far from uniform
    tokens, answers = _attention_items(BYTE, 5, 64, 2)
    attn = _all_attentions(cfg, fns, params, tokens)
    lengths = np.full((len(tokens), 1), tokens.shape[1], np.int32)
    needle = np.zeros(tokens.shape, bool)
    for r, (row, ans) in enumerate(zip(tokens, answers)):
        needle[r, I.answer_positions(BYTE, row, ans)] = True

    def stats(params, tokens, lengths, needle):
        model = fns.model(params)
        return I.retrieval_stats(model, tokens, I.eval_context(cfg, *tokens.shape), lengths, needle,
                                 I.attention_layers(model))
    score, entropy, _ = (np.asarray(a) for a in jax.jit(stats)(params, tokens, lengths, needle))
    want = official_head_scores(attn, [list(r) for r in tokens], answers, BYTE)
    np.testing.assert_allclose(score.mean(0), want, rtol=1e-4, atol=1e-7)
    ent = official_entropy(attn)
    want_ent = np.array([[ent[(layer, h)] for h in range(attn.shape[2])] for layer in range(attn.shape[1])])
    np.testing.assert_allclose(entropy.mean(0), want_ent, rtol=1e-4, atol=1e-6)
    assert not np.allclose(want_ent, 1.0)  # peaked: the test can tell the queries apart


def official_qk_rel_l2(q_proj: np.ndarray, k_proj: np.ndarray, q_ref: np.ndarray, k_ref: np.ndarray,
                       head_idx: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                       eps: float = 1e-12) -> float:
    """compute_weight_distance.py _slice_q, _slice_k, _distance and main() (lines ~99-193): HF
    ``q_proj.weight`` is ``[heads * head_dim, d_model]``; ``qk_rel_l2 = q_rel + k_rel``."""
    def _slice_q(weight, head_idx, head_dim):
        return weight[head_idx * head_dim:(head_idx + 1) * head_dim, :]

    def _slice_k(weight, head_idx, num_attention_heads, num_key_value_heads, head_dim):
        group_size = max(1, num_attention_heads // num_key_value_heads)
        kv_head = min(num_key_value_heads - 1, head_idx // group_size)
        return weight[kv_head * head_dim:(kv_head + 1) * head_dim, :]

    def _distance(curr, init, eps):
        l2 = float(np.linalg.norm(curr - init))
        return l2, l2 / (float(np.linalg.norm(init)) + eps)

    _, q_rel = _distance(_slice_q(q_proj, head_idx, head_dim), _slice_q(q_ref, head_idx, head_dim), eps)
    _, k_rel = _distance(_slice_k(k_proj, head_idx, num_attention_heads, num_key_value_heads, head_dim),
                         _slice_k(k_ref, head_idx, num_attention_heads, num_key_value_heads, head_dim), eps)
    return q_rel + k_rel


def test_d_qk_is_the_official_sum_of_relative_distances():
    rng = np.random.default_rng(3)
    d, H, K, Dh = 16, 6, 2, 4
    wq_ref, wk_ref = rng.normal(size=(d, H, Dh)), rng.normal(size=(d, K, Dh))
    wq = wq_ref + rng.normal(size=wq_ref.shape) * rng.uniform(0.05, 1.0, (1, H, 1))
    wk = wk_ref + rng.normal(size=wk_ref.shape) * 0.3
    ours = I.qk_distance(wq, wk, wq_ref, wk_ref)

    def hf(w):  # ours [d_model, heads, head_dim] -> HF [heads * head_dim, d_model]
        return w.reshape(w.shape[0], -1).T
    want = [official_qk_rel_l2(hf(wq), hf(wk), hf(wq_ref), hf(wk_ref), h, H, K, Dh) for h in range(H)]
    np.testing.assert_allclose(ours, want, rtol=1e-12)
    joint = np.sqrt(((wq - wq_ref) ** 2).sum((0, 2)) + ((wk - wk_ref) ** 2).sum((0, 2))[np.arange(H) // 3]) / \
        np.sqrt((wq_ref ** 2).sum((0, 2)) + (wk_ref ** 2).sum((0, 2))[np.arange(H) // 3])
    assert not np.allclose(ours / joint, (ours / joint)[0])  # not a constant factor from the joint norm


# ----------------------------------------------------------------------------- probing


def official_probe_prompt_repeat(key: str, value_str: str, num_haystack_repeats: int, insert_pos: int) -> str:
    """01_prepare_data.py generate_input_output_repeat (lines ~236-245), the random line passed in."""
    HAYSTACK_REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    TEMPLATE = """A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you about the number afterwards.
{context}
What is the special magic number for {query} mentioned in the provided text? The special magic number for {query} mentioned in the provided text is"""  # noqa: E501
    needle = f"One of the special magic numbers for {key} is: {value_str}."
    sentences = [HAYSTACK_REPEAT] * num_haystack_repeats
    sentences.insert(insert_pos, needle)
    context = "\n".join(sentences)
    return TEMPLATE.format(context=context, query=key)


def official_probe_prompt_essay(haystack_words, num_haystack_words: int, key: str, value_str: str, start_idx: int,
                                depth: int, sent_tokenize_func) -> str:
    """01_prepare_data.py generate_input_output_essay + insert_needle_by_depth (lines ~196-263)."""
    TEMPLATE = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
                "you about the number afterwards.\n{context}\nWhat is the special magic number for {query} mentioned "
                "in the provided text? The special magic number for {query} mentioned in the provided text is")
    needle = f"One of the special magic numbers for {key} is: {value_str}."
    text = " ".join(haystack_words[start_idx:start_idx + num_haystack_words])
    document_sents = sent_tokenize_func(text.strip())
    insertion_pos = int(len(document_sents) * (depth / 100))
    insertion_pos = min(insertion_pos, len(document_sents))
    document_sents_list = list(document_sents)
    document_sents_list.insert(insertion_pos, needle)
    return TEMPLATE.format(context=" ".join(document_sents_list), query=key)


def official_simple_sent_tokenize(text):
    """01_prepare_data.py simple_sent_tokenize (lines ~58-72)."""
    sentences = re.split(r'([.!?]+)\s+', text)
    result = []
    for i in range(0, len(sentences) - 1, 2):
        if i + 1 < len(sentences):
            result.append(sentences[i] + sentences[i + 1])
        else:
            result.append(sentences[i])
    if len(sentences) % 2 == 1:
        result.append(sentences[-1])
    return [s.strip() for s in result if s.strip()]


@pytest.mark.parametrize("seq_len", [4096, 16000])
def test_probe_prompts_are_the_official_recipe(seq_len):
    noise = RI.haystack_for("noise", BYTE)
    for index in range(3):
        text, key, value, _ = I.probe_text(seq_len, 0, index, noise)
        n = max(100, seq_len // 100)
        lines = text.split("\n")[1:-1]  # between the instruction and the question
        (pos,) = [i for i, line in enumerate(lines) if line.startswith("One of")]
        assert len(lines) == n + 1 and n // 4 <= pos <= 3 * n // 4 and value == str(31415920 + index % 8)
        assert text == official_probe_prompt_repeat(key, value, n, pos)
    essays = RI.haystack_for("essays", BYTE)
    words = I.haystack_words(essays)
    assert words == re.sub(r"\s+", " ", " ".join(essays.texts)).split(" ")
    for index in range(3):
        text, key, value, depth = I.probe_text(seq_len, 1, index, essays)
        num = min(max(1000, seq_len // 4), len(words))
        context = text.split("\n", 1)[1].rsplit("\nWhat is", 1)[0]
        needle = f"One of the special magic numbers for {key} is: {value}."
        first = context.replace(needle + " ", "").replace(" " + needle, "").split(" ")[:3]
        starts = [i for i in range(len(words) - num + 1) if words[i:i + 3] == first]
        assert round(depth * 100) in I.ESSAY_DEPTHS
        assert any(text == official_probe_prompt_essay(words, num, key, value, s, round(depth * 100),
                                                       official_simple_sent_tokenize) for s in starts)
    assert I.simple_sent_tokenize("A b. C d!  E f? g") == official_simple_sent_tokenize("A b. C d!  E f? g")


def test_probe_features_are_hf_hidden_states_after_each_layer():
    """02_extract_hiddenstate.py keeps ``outputs.hidden_states[1 .. L]`` at the last token; in a HF
    decoder ``hidden_states[L]`` is the final norm's output. Here: the blocks' outputs, the last one
    through the final norm, which is the model's own ``features=True`` forward at that position."""
    cfg, fns, params = _tiny(layers=3, pattern="FEF")
    tokens = np.random.default_rng(4).integers(0, 256, (3, 20)).astype(np.int32)
    last = np.array([[19], [11], [4]], np.int32)

    def both(params, tokens, last):
        model = fns.model(params)
        ctx = I.eval_context(cfg, *tokens.shape)
        states = I.run_layers(model, tokens, ctx)  # [embedding, block 0, ..., block L-1]
        hf = states[:-1] + [model.final_norm(states[-1])]  # HF's hidden_states
        want = jnp.stack([h[jnp.arange(3), last[:, 0]] for h in hf[1:]], 1)
        return I.hidden_states(model, tokens, ctx, last), want, model(tokens, ctx, features=True)
    ours, want, feats = (np.asarray(a) for a in jax.jit(both)(params, tokens, last))
    assert ours.shape == (3, 3, cfg.model.d_model)
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ours[:, -1], feats[np.arange(3), last[:, 0]], rtol=1e-5, atol=1e-6)


def official_liblinear_ovr(X_train, y_train, X_test, C: float = 0.1):
    """03_train_probing.py's classifier, ``LogisticRegression(solver='liblinear', C=0.1, multi_class='ovr')``,
    as the problem liblinear solves: per class k, ``min 0.5 |w~|^2 + C sum log(1 + exp(-y_i w~ . x~_i))``
    over ``w~ = [w, b]``, ``x~ = [x, 1]`` (intercept_scaling 1: the bias is regularised too), y_i = +-1;
    the prediction is the class of the largest ``w~ . x~``. Solved here to a tight tolerance."""
    from scipy.optimize import minimize

    classes = np.unique(y_train)
    Xt = np.hstack([X_train, np.ones((len(X_train), 1))])
    W = []
    for k in classes:
        y = np.where(y_train == k, 1.0, -1.0)

        def f(w):
            m = y * (Xt @ w)
            loss = 0.5 * w @ w + C * np.logaddexp(0, -m).sum()
            grad = w - C * Xt.T @ (y / (1 + np.exp(m)))
            return loss, grad
        W.append(minimize(f, np.zeros(Xt.shape[1]), jac=True, method="L-BFGS-B",
                          options={"gtol": 1e-10, "ftol": 1e-14, "maxiter": 10000}).x)
    W = np.stack(W)
    scores = np.hstack([X_test, np.ones((len(X_test), 1))]) @ W.T
    return classes[np.argmax(scores, 1)], W


def test_probe_classifier_is_the_official_one():
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    from hybrid_lm.eval import probe as P

    rng = np.random.default_rng(5)
    labels = np.arange(240) % 8
    feats = rng.normal(size=(240, 2, 12))
    feats[:, 1, :8] += 1.2 * np.eye(8)[labels]  # layer 1: a weak class signal, so the test split has errors
    ours = P.probe_accuracy(feats, labels)
    for layer in range(2):  # 03_train_probing.py main(): split, scale, fit, score
        X_train, X_test, y_train, y_test = train_test_split(feats[:, layer], labels, test_size=0.2, random_state=42,
                                                            stratify=labels)
        scaler = StandardScaler()
        X_train = scaler.fit_transform(X_train)
        X_test = scaler.transform(X_test)
        pred, W = official_liblinear_ovr(X_train, y_train, X_test)
        assert ours[layer] == pytest.approx(np.mean(pred == y_test), abs=1 / len(y_test) + 1e-9)
        clf = P.official_classifier().fit(X_train, y_train)
        coef = np.stack([np.r_[e.coef_[0], e.intercept_] for e in clf.estimators_]) if hasattr(clf, "estimators_") \
            else np.hstack([clf.coef_, clf.intercept_[:, None]])
        np.testing.assert_allclose(coef, W, rtol=2e-3, atol=2e-3)
    assert 0.2 < ours[1] < 1.0 and ours[0] < 0.35


# ----------------------------------------------------------------------------- RULER


def official_vt_input(num_noises: int, chain_vars: list[str], value: str, positions: list[int], template: str,
                      num_hops: int = 4) -> str:
    """variable_tracking.py generate_chains + generate_input_output, noise haystack, one chain (lines
    ~93-177), the random choices passed in."""
    haystack = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    this_chain = [f"VAR {chain_vars[0]} = {value}"]
    for j in range(num_hops):
        this_chain.append(f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} ")
    chains = [this_chain]
    sentences = [haystack] * num_noises
    for chain in chains:
        for insert_pi, j in zip(positions, range(len(chain))):
            sentences.insert(insert_pi + j, chain[j])
    context = "\n".join(sentences)
    context = context.replace(". \n", ".\n")
    return template.format(context=context, query=value, num_v=num_hops + 1)


def official_vt_prompt(example: str, input_text: str, example_outputs: list[str]) -> str:
    """variable_tracking.py sys_vartrack_w_noise_random: the one-shot example (its input, a space, its
    answer joined by spaces, a newline) inserted before the template, then a newline (lines ~216-265)."""
    icl_example = example + " " + " ".join(example_outputs) + "\n"
    template_start = "Memorize and track the chain(s) of variable assignment hidden in the following text."[:20]
    cutoff = input_text.index(template_start)
    return input_text[:cutoff] + icl_example + "\n" + input_text[cutoff:]


VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above. Answer: "
               "According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
               "the value {query}, they are: ")  # constants.py template + answer_prefix


def _parse_vt(part: str):
    """(names in chain order, value, statement line indexes in the original haystack, noise lines)."""
    context = part.split("\n\n", 1)[1].rsplit("\nQuestion:", 1)[0]
    lines = context.split("\n")
    stmts = [(i, line) for i, line in enumerate(lines) if line.startswith("VAR")]
    names = [re.match(r"VAR (\w+) =", s).group(1) for _, s in stmts]
    value = re.match(r"VAR \w+ = (\d+)", stmts[0][1]).group(1)
    positions = [i - j for j, (i, _) in enumerate(stmts)]
    return names, value, positions, len(lines) - len(stmts)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_vt_prompt_is_the_official_one(tokenizer, bpe):
    tok = BYTE if tokenizer == "byte" else bpe
    noise = RI.haystack_for("noise", tok)
    for index in range(3):
        item = RI.make_item("vt", 4096, 0, index, tok, noise)
        text = tok.decode(item.ids)
        example, main = text.split(" they are: ", 1)[0] + " they are: ", text.split(" they are: ", 1)[1]
        ex_answer, main = main.split("\n", 1)
        assert main.startswith("\nMemorize and track")
        # the one-shot example: exactly RULER's, built from its own random choices, then renamed per item
        names, value, positions, n = _parse_vt(example)
        assert [len(x) for x in names] == [3] * 5 and ex_answer.split() == names
        assert example == official_vt_input(n, names, value, positions, VT_TEMPLATE)
        # the prompt: RULER's, its last noise line cut at the end to fill the length exactly
        names, value, positions, n = _parse_vt(main[1:])
        assert list(item.answers) == names and item.gold == " " + " ".join(names) and not item.distractors
        want = official_vt_prompt(example, official_vt_input(n, names, value, positions, VT_TEMPLATE), ex_answer.split())
        cut = want.rindex("\nQuestion:")
        head = text[:text.rindex("\nQuestion:")]
        assert want[:cut].startswith(head) and "\n" not in want[len(head):cut]
        assert text[len(head):] == want[cut:]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_vt_example_is_the_most_noise_within_500_tokens(tokenizer, bpe):
    """variable_tracking.py main(): the example is built for max_seq_length=500 with 0 tokens to
    generate (the binary search over noise lines, at least 5), before the names are randomised."""
    tok = BYTE if tokenizer == "byte" else bpe
    example = RI.vt_example(tok, RI.haystack_for("noise", tok), 0)
    prompt, answer = example.rsplit(" they are: ", 1)
    prompt += " they are: "
    names, value, positions, n = _parse_vt(prompt)
    assert value == "12345" and answer == " " + " ".join(names) + "\n"
    assert prompt == official_vt_input(n, names, value, positions, VT_TEMPLATE)
    fits = len(tok.encode(prompt)) <= RI.VT_ICL_TOKENS
    assert fits or n == 5  # none fits: RULER keeps its increment, 5 lines
    bigger = official_vt_input(n + 1, names, value, positions, VT_TEMPLATE)
    assert len(tok.encode(bigger)) > RI.VT_ICL_TOKENS


def official_prediction(generated_ids: list[int], eos_token_id: int, max_new_tokens: int, decode) -> str:
    """HF ``generate`` greedy with ``max_new_tokens`` (call_api.py: the task's tokens_to_generate)
    stopping at ``eos_token_id``, ``batch_decode(skip_special_tokens=True)``, then evaluate.py
    postprocess_pred (lines ~53-61)."""
    out = []
    for token in generated_ids[:max_new_tokens]:
        out.append(token)
        if token == eos_token_id:
            break
    predict_str = decode([t for t in out if t != eos_token_id]).strip()
    np_pattern = re.compile(r'[\x00-\x1f]')
    return np_pattern.sub('\n', predict_str).strip()


def official_string_match_all(preds, refs):
    """scripts/eval/synthetic/constants.py string_match_all (x 100, rounded: here the fraction)."""
    return sum([sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref)
                for pred, ref in zip(preds, refs)]) / len(preds)


def test_generation_stops_at_eos_and_the_task_budget(bpe):
    """constants.py tokens_to_generate: niah 128, vt 30, cwe 120, fwe 50."""
    assert RI.TOKENS_TO_GENERATE == {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
    eos = int(bpe.separator[0])
    rng = np.random.default_rng(6)
    answer = [int(x) for x in bpe.encode(" 3141592")]
    for trial in range(40):
        ids = [int(x) for x in rng.integers(0, 300, 140)]
        at = int(rng.integers(0, 135))
        ids[at:at + len(answer)] = answer
        if trial % 2:
            ids[int(rng.integers(0, 140))] = eos
        if trial % 5 == 0:
            ids[3] = bpe.encode("\x07")[0]
        for task in ("niah_single", "vt", "cwe", "fwe"):
            want = official_prediction(ids, eos, RI.TOKENS_TO_GENERATE[RI.family(task)], bpe.decode)
            got = R.continuation(bpe, np.asarray(ids), task)
            assert got == want
            assert R.string_match_all(got, ["3141592"]) == official_string_match_all([want], [["3141592"]])
    # the byte tokenizer has no EOS id: its document separator "\n\n" ends the continuation
    assert R.continuation(BYTE, BYTE.encode(" 1234567.\n\nThe end"), "niah_single") == "1234567."
    assert R.continuation(BYTE, BYTE.encode("x" * 40 + " 1234567"), "vt") == "x" * 30


def test_ruler_constants_and_formulas_are_the_official_ones():
    from scipy.special import zeta

    assert RI.DEPTHS == tuple(np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
    # niah.py: the singular rewrite of the template when one answer is asked
    template, type_v = RI.niah_template(1)
    assert type_v == "number" and template.format(type_needle_v=type_v, context="C", query="k") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
        "about the number afterwards.\nC\nWhat is the special magic number for k mentioned in the provided text? "
        "The special magic number for k mentioned in the provided text is")
    # freq_words_extraction.py gen_text: int(num_words * k^-alpha / zeta(alpha))
    for num_words, vocab_size in ((1000, 40), (12345, 300)):
        k = np.arange(1, vocab_size + 1)
        np.testing.assert_array_equal(RI.zipf_counts(num_words, vocab_size),
                                      (num_words * (k ** -2.0) / zeta(2.0)).astype(int))
    # evaluate.py postprocess_pred
    assert R.postprocess_pred("  a\tb\x01c \n") == "a\nb\nc"


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey"])
def test_essay_needles_go_before_the_official_sentence_index(task):
    """niah.py: needle k goes before sentence ``int(n_sentences * depth / 100)`` of the haystack."""
    essays = RI.haystack_for("essays", BYTE)
    for index in range(4):
        item = RI.make_item(task, 4096, 2, index, BYTE, essays)
        text = BYTE.decode(item.ids)
        context = text.split("\n", 1)[1].rsplit("\nWhat is", 1)[0]
        assert context.startswith(essays.texts[0][:30])  # RULER: the essays from their first word
        needles = [BYTE.decode(item.ids[a:b]).strip() for a, b in item.needle_spans]
        rest = context
        for nd in needles:
            rest = rest.replace(" " + nd, "", 1) if (" " + nd) in rest else rest.replace(nd + " ", "", 1)
        n_units = essays.count(len(BYTE.encode(rest)))
        for (a, _), depth in zip(item.needle_spans, item.depths):
            before = BYTE.decode(item.ids[:a]).split("\n", 1)[1]
            for nd in needles:
                before = before.replace(" " + nd, "").replace(nd + " ", "").replace(nd, "")
            k = round(depth * n_units)
            assert before.strip() == " ".join(essays.texts[:k]).strip()
            assert any(int(n_units * (d / 100)) == k for d in RI.DEPTHS)


# ----------------------------------------------------------------------------- LongPPL


def _toy_logits(tokens: np.ndarray, vocab: int = 40) -> np.ndarray:
    """``[1, n, vocab]``: a copy model: position i puts logit 8 on the token 29 places back (which the
    toy documents repeat at the next position), so a target is predicted only with 30 tokens of context."""
    n = tokens.shape[1]
    logits = np.zeros((1, n, vocab), np.float32)
    for i in range(29, n):
        logits[0, i, tokens[0, i - 29]] += 8.0
    return logits


def _log_softmax(x):
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def official_find_key_token(input_ids: np.ndarray, evaluator, trunc_len: int, sliding_window: int, alpha=2, beta=-2):
    """longppl.py find_key_token (lines ~22-50): the evaluator's key token positions."""
    def loss_f(logits, targets):
        return -np.take_along_axis(_log_softmax(logits), targets[:, None], -1)[:, 0]

    output_full = evaluator(input_ids)
    _, max_len = input_ids.shape
    key_tokens = []
    for start_token in range(0, max_len - trunc_len, sliding_window):
        if start_token + trunc_len + sliding_window > max_len:
            sliding_window = max_len - start_token - trunc_len
        input_ids_short = input_ids[:, start_token: start_token + trunc_len + sliding_window]
        output_short = evaluator(input_ids_short)
        loss_full = loss_f(output_full[0, start_token + trunc_len - 1: start_token + trunc_len + sliding_window - 1, :],
                           input_ids[0, start_token + trunc_len: start_token + trunc_len + sliding_window])
        loss_short = loss_f(output_short[0, trunc_len - 1: trunc_len + sliding_window - 1, :],
                            input_ids_short[0, trunc_len: trunc_len + sliding_window])
        loss_discrepancy = np.logical_and((loss_short - loss_full) > alpha, loss_full < (beta * -1))
        for i, is_key in enumerate(loss_discrepancy):
            if is_key:
                key_tokens.append(start_token + trunc_len + i)
    return key_tokens


def official_compute_longppl(input_ids: np.ndarray, model, key_positions: list[int]) -> dict:
    """longppl.py compute_longppl (lines ~145-173) with one tokenizer for both models and no BOS: a
    token's text span is its own, so cal_overlap maps key token p to the loss index p - 1."""
    key_text_slices = [[p, p + 1] for p in key_positions]
    offset_mapping = [[i, i + 1] for i in range(input_ids.shape[1])]
    key_tokens, i, j = [], 0, 0  # cal_overlap
    while i < len(offset_mapping) and j < len(key_text_slices):
        a_start, a_end = offset_mapping[i]
        b_start, b_end = key_text_slices[j]
        if a_start >= b_start and a_end <= b_end:
            key_tokens.append(i - 1)
            i += 1
        elif a_start < b_start:
            i += 1
        else:
            j += 1
    logits = model(input_ids)
    loss_overall = -np.take_along_axis(_log_softmax(logits[0, :-1]), input_ids[0, 1:, None], -1)[:, 0]
    if not key_tokens:
        return {"longppl": None, "n_key_token": None, "ppl": np.exp(loss_overall.mean()), "n_token": input_ids.shape[-1]}
    return {"longppl": np.exp(loss_overall[key_tokens].mean()), "n_key_token": len(key_tokens),
            "ppl": np.exp(loss_overall.mean()), "n_token": input_ids.shape[-1], "key_tokens": key_tokens}


def official_corpus(outputs: list[dict]) -> dict:
    """perplexity.py compute_perplexity's running corpus values (lines ~62-68)."""
    longppls = [o["longppl"] for o in outputs if o["longppl"] is not None]
    nums_key = [o["n_key_token"] for o in outputs if o["longppl"] is not None]
    ppls, nums_token = [o["ppl"] for o in outputs], [o["n_token"] for o in outputs]
    longppl = np.exp((np.log(np.stack(longppls)) * np.stack(nums_key)).sum() / np.stack(nums_key).sum())
    ppl = np.exp((np.log(np.stack(ppls)) * np.stack(nums_token)).sum() / np.stack(nums_token).sum())
    return {"longppl": longppl, "ppl": ppl}


@pytest.mark.integration  # a model's whole eval task
def test_longppl_key_tokens_and_values_are_the_official_ones():
    from hybrid_lm.eval.longppl import KeyTokenRule, key_tokens, longppl, nll_per_token

    rng = np.random.default_rng(7)
    K, W = 24, 10
    docs = []
    for n in (97, 120):  # lengths whose last window is shortened
        doc = rng.integers(0, 40, n)
        for p in range(30, n):
            if rng.random() < 0.8:
                doc[p] = doc[p - 30]  # predictable from 30 tokens back, only with enough context
        docs.append(doc[None].astype(np.int32))
    nll_fn = lambda t: np.asarray(nll_per_token(lambda x: jnp.asarray(_toy_logits(np.asarray(x))), jnp.asarray(t)))  # noqa: E731
    ours_keys, ours_full, official = [], [], []
    for doc in docs:
        want = official_find_key_token(doc, _toy_logits, K, W)
        key, full = key_tokens(nll_fn, doc, KeyTokenRule(trunc_len=K, window=W))
        assert sorted(np.flatnonzero(key[0]).tolist()) == want and len(want) > 3
        out = official_compute_longppl(doc, _toy_logits, want)
        assert out["key_tokens"] == [p - 1 for p in want]
        ours_keys.append(key[0])
        ours_full.append(full[0])
        official.append(out)
        mine = longppl([full[0]], [key[0]])
        assert mine["longppl"] == pytest.approx(float(out["longppl"]), rel=1e-5)
        assert mine["ppl"] == pytest.approx(float(out["ppl"]), rel=1e-5) and mine["n_token"] == out["n_token"]
    corpus, want = longppl(ours_full, ours_keys), official_corpus(official)
    assert corpus["longppl"] == pytest.approx(float(want["longppl"]), rel=1e-5)
    assert corpus["ppl"] == pytest.approx(float(want["ppl"]), rel=1e-5)

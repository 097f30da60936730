"""RULER-offline (Hsieh et al. 2024, NVIDIA/RULER): synthetic long-context tasks, generated here with
no download, scored by greedy generation and by the answer's log-likelihood.

Tasks (``TASKS``; docs/EVAL.md has the templates and the scoring):

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." in a
  haystack; asked for the key's value.
- ``niah_multikey``: four needles with different keys; asked for one key (the other three values
  are the distractors).
- ``niah_multivalue``: four needles with the same key and four values; all four must be returned.
- ``niah_multiquery``: four keys with a value each; asked for all four at once.
- ``vt``: variable tracking: two chains ``VAR A = 12345. VAR B = VAR A. ...`` (five variables each)
  in a haystack; asked for every variable holding the first chain's value (the second chain is the
  distractor).
- ``cwe``: common-word extraction: a numbered list of words where a few words repeat much more
  often than the rest; asked for the most common ones.
- ``fwe``: frequent-word extraction: coded words drawn from a Zipf law (the most frequent is "...",
  noise); asked for the three most frequent coded words.

Haystacks for the needle tasks (``niah_*``, ``vt``): ``essays`` (the embedded Paul Graham essays),
``corpus`` (the run's token store, val split, decoded) or ``noise`` (repeated sentences "The grass
is green. ..."). ``cwe`` and ``fwe`` are their own haystack.

Items. :func:`make_item` is a pure function of (task, length, seed, index, tokenizer, haystack):
a prompt of exactly ``length - gen_tokens`` token ids of the run's tokenizer, so prompt plus answer
(or generation) is ``length`` tokens and every item of a (task, length) has one shape (batched, one
compile). The prompt is assembled from separately encoded pieces (template, haystack sentences,
needles), the haystack cut at the token to fill the budget exactly; needles sit at sentence
boundaries at controlled depths (one needle: depth van-der-Corput(index), so any number of samples
spreads over [0, 1); several: distinct points of a 40-point grid, sorted, as RULER). ``gen_tokens``
bounds the answer's tokens (its UTF-8 bytes + 2: no supported tokenizer needs more for ASCII); it is
the same for every task at a length (the longest answer any task may need), so one compiled
generation and one compiled forward pass serve all tasks of a length.
:func:`load_items` caches items under ``data_cache/ruler/`` keyed by (generator version, task,
length, seed, tokenizer fingerprint, haystack identity).

Scores (:func:`evaluate_ruler`): ``exact_match``, the fraction of the expected strings present in the
greedy continuation (case-insensitive, RULER's ``string_match_all``), from ``eval/generate.py``'s
cached decoding; ``answer_nll``, the mean NLL per token of the gold answer under teacher forcing
(one forward pass, every mixer, SA included); ``ll_accuracy``, the fraction of items where the gold
answer's log-likelihood beats every distractor's (tasks with distractors; chance 1 / (1 + count)).
Mixers without a decode path (attention_sink) get the log-likelihood scores only; sa and sa_swa decode
as their option ``decode`` says (docs/STOCHASTIC_ATTENTION.md §9).

Python: ``rows, skipped = evaluate_ruler(RestoredRun(wd), tasks=["niah_single"], lengths=[4096])``;
CLI: ``hybrid-lm ruler RUN_DIR --tasks niah_single,vt --lengths 4K,8K --samples 16``.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import math
import re
import time
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from hybrid_lm.errors import ConfigError
from hybrid_lm.experiment import run_id

log = logging.getLogger(__name__)

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
HAYSTACK_TASKS = frozenset({"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"})
HAYSTACKS = ("essays", "corpus", "noise")
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
GENERATOR_VERSION = 1  # bump when an item for the same key would change (invalidates the cache)

MIN_HAYSTACK = 16  # tokens of haystack an item needs, at least
CORPUS_TOKENS = 4_000_000  # the corpus haystack: the val split's first documents up to this many tokens
MULTI_DEPTHS = np.linspace(0.0, 1.0, 40)  # RULER's depth grid for several needles
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")

# (keys, values per key, keys asked) of each NIAH task (RULER's niah_single_2, multikey_1, multivalue, multiquery)
NIAH = {"niah_single": (1, 1, 1), "niah_multikey": (4, 1, 1), "niah_multivalue": (1, 4, 1),
        "niah_multiquery": (4, 1, 4)}
VT_CHAINS, VT_HOPS = 2, 4  # two chains of five variables: one asked, one the distractor
FWE_ALPHA, FWE_WORD_LEN, FWE_ANSWERS = 2.0, 6, 3
CWE_MAX_WORD = 10
N_DISTRACTORS = 3  # cwe and fwe: alternative answers scored against the gold one

TEMPLATES = {
    "niah_prefix_one": "A special magic number is hidden in the text below. Memorize it.\n",
    "niah_prefix_many": "Special magic numbers are hidden in the text below. Memorize them.\n",
    "niah_needle": " One of the special magic numbers for {key} is: {value}.",
    "niah_question_one": "\nWhat is the special magic number for {query}? The special magic number for {query} is:",
    "niah_question_many": ("\nWhat are all the special magic numbers for {query}? The special magic numbers for "
                           "{query} are:"),
    "vt_prefix": "Memorize and track the chains of variable assignments hidden in the text below.\n",
    "vt_question": ("\nQuestion: Find all variables that are assigned the value {value} in the text above. "
                    "Answer: According to the chains of variable assignments in the text above, {n} variables "
                    "are assigned the value {value}, they are:"),
    "cwe_prefix": ("Below is a numbered list of words. Some words appear more often than others. Memorize the "
                   "ones that appear most often.\n"),
    "cwe_question": ("\nQuestion: What are the {n} most common words in the list above? Answer: The {n} most "
                     "common words in the list are:"),
    "fwe_prefix": ("Read the following coded text and track the frequency of each coded word. Find the three "
                   "most frequently appeared coded words.\n"),
    "fwe_question": ("\nQuestion: Ignore the dots '...'. What are the three most frequently appeared coded words "
                     "in the text above? Answer: The three most frequently appeared coded words are:"),
}


class TooShort(ConfigError):
    """A (task, length) whose template, needles and answer leave no room for the task's content."""


# ----------------------------------------------------------------------------- items


@dataclasses.dataclass(frozen=True)
class Item:
    """One RULER prompt: ``ids`` (exactly ``length - gen_tokens`` token ids), the strings a correct
    answer contains (``answers``), the teacher-forced ``gold`` continuation and its ``distractors``,
    the needles' depths (fraction of the haystack before each) and token spans ``[start, end)``."""

    task: str
    length: int
    seed: int
    index: int
    haystack: str | None
    ids: np.ndarray
    gen_tokens: int
    answers: tuple[str, ...]
    gold: str
    distractors: tuple[str, ...] = ()
    depths: tuple[float, ...] = ()
    needle_spans: tuple[tuple[int, int], ...] = ()

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["ids"] = base64.b64encode(np.asarray(self.ids, "<u4").tobytes()).decode("ascii")
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Item":
        ids = np.frombuffer(base64.b64decode(d["ids"]), "<u4").astype(np.int32)
        return cls(**{**d, "ids": ids, "answers": tuple(d["answers"]), "distractors": tuple(d["distractors"]),
                      "depths": tuple(d["depths"]), "needle_spans": tuple(tuple(s) for s in d["needle_spans"])})


def item_rng(task: str, length: int, seed: int, index: int) -> np.random.Generator:
    """The random stream of one item (crc32 of the task name: stable across processes)."""
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])


def single_depth(index: int) -> float:
    """Depth of item ``index``'s one needle: the base-2 van der Corput sequence (0, 1/2, 1/4, 3/4,
    1/8, ...), so the first N items of any N spread evenly over [0, 1)."""
    out, scale = 0.0, 0.5
    while index:
        out += scale * (index & 1)
        index >>= 1
        scale /= 2
    return out


def _encode(tok, text: str) -> np.ndarray:
    return np.asarray(tok.encode(text), np.int32)


def _gen_budget(longest_answer: str) -> int:
    """Tokens reserved for the answer: its UTF-8 bytes + 2 bound its token count for the byte
    tokenizer, byte-level BPE and SentencePiece (a dummy-prefix piece) on ASCII text."""
    return len(longest_answer.encode("utf-8")) + 2


def _answer_text(words) -> str:
    return " " + ", ".join(words) + "."


def _distinct(rng: np.random.Generator, n: int, draw) -> list:
    """``n`` distinct draws of ``draw(rng)``, in the order drawn."""
    out, seen = [], set()
    while len(out) < n:
        x = draw(rng)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _number(rng, digits: int) -> str:
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _letters(rng, k: int, alphabet: str) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), k))


# ----------------------------------------------------------------------------- words and haystacks


@lru_cache(maxsize=1)
def essay_texts() -> tuple[tuple[str, str], ...]:
    from hybrid_lm.data.sources import embedded_documents
    return tuple(embedded_documents())


@lru_cache(maxsize=1)
def essays_identity() -> str:
    """sha256 of the embedded essays (names and texts): the word list's and the essay haystack's identity."""
    h = hashlib.sha256()
    for name, text in essay_texts():
        h.update(f"{name}\0{text}\0".encode())
    return "essays:" + h.hexdigest()[:16]


@lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """Lower-case words of 3 to 10 letters in the essays, sorted: the needle keys ("word-word") and
    the cwe word list."""
    pattern = re.compile(r"(?<![A-Za-z'])[a-z]{3,%d}(?![A-Za-z'])" % CWE_MAX_WORD)
    return tuple(sorted({w for _, text in essay_texts() for w in pattern.findall(text)}))


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (whitespace runs folded to one space, split after . ! or ?)."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in re.split(r"(?<=[.!?]) ", text) if s]


@dataclasses.dataclass(frozen=True)
class Haystack:
    """Sentences (each encoded with its leading space) that needle tasks fill their context with."""

    name: str
    identity: str  # what the items' cache key records
    units: tuple[np.ndarray, ...]

    def fill(self, start: int, n_tokens: int) -> list[np.ndarray]:
        """Sentences from ``start`` on (wrapping around) totalling exactly ``n_tokens`` ids: the first
        one cut at its front, so the haystack starts mid-sentence and ends at a sentence end."""
        out, total, k = [], 0, start
        while total < n_tokens:
            out.append(self.units[k % len(self.units)])
            total += len(out[-1])
            k += 1
        excess = total - n_tokens
        while excess >= len(out[0]):  # the last sentence alone may be longer than the first
            excess -= len(out.pop(0))
        out[0] = out[0][excess:]
        return out


_HAYSTACKS: dict[tuple, Haystack] = {}


def _haystack(name: str, identity: str, tok, sentences) -> Haystack:
    key = (identity, tok.fingerprint)
    if key not in _HAYSTACKS:
        sentences = list(sentences())
        if not sentences:
            raise ConfigError(f"the {name} haystack holds no text")
        units = tuple(np.asarray(ids, np.int32) for ids in tok.encode_batch([" " + s for s in sentences]))
        _HAYSTACKS[key] = Haystack(name, identity, tuple(u for u in units if len(u)))
    return _HAYSTACKS[key]


def essays_haystack(tok) -> Haystack:
    return _haystack("essays", essays_identity(), tok,
                     lambda: (s for _, text in essay_texts() for s in split_sentences(text)))


def noise_haystack(tok) -> Haystack:
    return _haystack("noise", "noise", tok, lambda: NOISE_SENTENCES)


def corpus_haystack(tok, store) -> Haystack:
    """The val split of ``store`` (a :class:`~hybrid_lm.data.store.TokenStore` of ``tok``), decoded
    document by document (its first documents, up to ``CORPUS_TOKENS`` tokens)."""
    if store.tokenizer.get("fingerprint") != tok.fingerprint:
        raise ConfigError(f"token store {store.path} was prepared with another tokenizer than the run's")
    view = store.split("val")
    if view.n_docs == 0:
        raise ConfigError(f"token store {store.path} has no val documents: use --haystack essays or noise")

    def sentences():
        starts, used = view.doc_starts, 0
        for d in range(view.n_docs):
            n = int(min(starts[d + 1] - starts[d], CORPUS_TOKENS - used))
            yield from split_sentences(tok.decode(view.read(int(starts[d]), n)))
            used += n
            if used >= CORPUS_TOKENS:
                return
    return _haystack("corpus", f"corpus:{store.fingerprint[:16]}", tok, sentences)


def haystack_for(name: str, tok, run=None) -> Haystack:
    """The ``name`` haystack (one of ``HAYSTACKS``) in ``tok``'s ids; ``corpus`` needs the
    :class:`~hybrid_lm.eval.restore.RestoredRun` whose token store it reads."""
    if name == "essays":
        return essays_haystack(tok)
    if name == "noise":
        return noise_haystack(tok)
    if name == "corpus":
        if run is None:
            raise ConfigError("the corpus haystack reads a run's token store: give the run")
        return corpus_haystack(tok, run.streams().store)
    raise ConfigError(f"--haystack {name!r}: choose one of {', '.join(HAYSTACKS)}")


_PIECES: dict[tuple, list[np.ndarray]] = {}


def _pieces(tok, kind: str, n: int) -> list[np.ndarray]:
    """Memoized encodings per tokenizer: ``numbers`` (" 1.", " 2.", ... at least ``n`` of them) or
    ``words`` (" " + each of :func:`words`)."""
    key = (tok.fingerprint, kind)
    have = _PIECES.setdefault(key, [])
    if kind == "words" and not have:
        have += [np.asarray(x, np.int32) for x in tok.encode_batch([" " + w for w in words()])]
    elif kind == "numbers" and len(have) < n:
        more = max(n, 2 * len(have), 1024)
        have += [np.asarray(x, np.int32) for x in tok.encode_batch([f" {i}." for i in range(len(have) + 1, more + 1)])]
    return have


def _single_token(tok, char: str) -> int:
    """The id that decodes to ``char`` alone."""
    for text in (char, "a" + char, " " + char):
        for i in reversed(tok.encode(text).tolist()):
            if tok.decode([i]) == char:
                return int(i)
    raise ConfigError(f"the tokenizer {tok.spec!r} has no single token for {char!r}, which fwe pads with")


# ----------------------------------------------------------------------------- generators


def _place(prefix: np.ndarray, hay: list[np.ndarray], needles: list[np.ndarray], depths, question: np.ndarray):
    """``prefix + haystack with needles + question``: needle i goes to the sentence boundary nearest to
    ``depths[i]`` of the haystack's tokens (depths non-decreasing keep the needles' order). Returns
    (ids, [(start, end)] of each needle, the depth of each as placed)."""
    bounds = np.concatenate([[0], np.cumsum([len(u) for u in hay])])
    total = int(bounds[-1])
    at, last = [], 0
    for d in depths:
        last = max(last, int(np.argmin(np.abs(bounds - d * total))))
        at.append(last)
    pieces, spans, pos, k = [prefix], [], len(prefix), 0
    for b in range(len(hay) + 1):
        while k < len(needles) and at[k] == b:
            pieces.append(needles[k])
            spans.append((pos, pos + len(needles[k])))
            pos += len(needles[k])
            k += 1
        if b < len(hay):
            pieces.append(hay[b])
            pos += len(hay[b])
    pieces.append(question)
    placed = tuple(float(bounds[b] / total) if total else 0.0 for b in at)
    return np.concatenate(pieces).astype(np.int32), tuple(spans), placed


def _needle_item(task, length, seed, index, tok, haystack: Haystack, rng, *, prefix, needles, depths, question,
                 gen_tokens, **fields) -> Item:
    """An item of a needle task: the haystack fills what template, needles and answer leave."""
    prefix_ids, question_ids = _encode(tok, prefix), _encode(tok, question)
    needle_ids = [_encode(tok, n) for n in needles]
    fixed = len(prefix_ids) + len(question_ids) + sum(len(n) for n in needle_ids) + gen_tokens
    n_hay = length - fixed
    if n_hay < MIN_HAYSTACK:
        raise TooShort(f"{task} needs at least {fixed + MIN_HAYSTACK} tokens with this tokenizer (template, "
                       f"needles and answer take {fixed}); {length} is too short")
    hay = haystack.fill(int(rng.integers(len(haystack.units))), n_hay)
    ids, spans, placed = _place(prefix_ids, hay, needle_ids, depths, question_ids)
    return Item(task, length, seed, index, haystack.name, ids, gen_tokens, depths=placed, needle_spans=spans,
                **fields)


def _niah(task, length, seed, index, tok, haystack, depths=None) -> Item:
    n_keys, n_values, n_queries = NIAH[task]
    rng = item_rng(task, length, seed, index)
    vocab = words()
    keys = _distinct(rng, n_keys, lambda r: f"{vocab[r.integers(len(vocab))]}-{vocab[r.integers(len(vocab))]}")
    drawn = _distinct(rng, n_keys * n_values, lambda r: _number(r, 7))  # no value twice, across keys too
    values = {k: drawn[i * n_values:(i + 1) * n_values] for i, k in enumerate(keys)}
    needles = [(k, v) for k in keys for v in values[k]]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    if depths is None:
        depths = ([single_depth(index)] if len(needles) == 1 else
                  sorted(rng.choice(MULTI_DEPTHS, len(needles), replace=False).tolist()))
    queries = [keys[i] for i in rng.permutation(n_keys)[:n_queries]]
    if n_queries * n_values == 1:
        prefix, question = TEMPLATES["niah_prefix_one"], TEMPLATES["niah_question_one"]
    else:
        prefix, question = TEMPLATES["niah_prefix_many"], TEMPLATES["niah_question_many"]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if n_values > 1:  # one key: its values in the order they appear in the text
        answers = [v for _, v in needles]
    else:
        answers = [values[q][0] for q in queries]
    distractors = [_answer_text([values[k][0]]) for k in keys if k not in queries]
    return _needle_item(
        task, length, seed, index, tok, haystack, rng,
        prefix=prefix, question=question.format(query=query), depths=list(depths),
        needles=[TEMPLATES["niah_needle"].format(key=k, value=v) for k, v in needles],
        gen_tokens=answer_budget(tok, length),
        answers=tuple(answers), gold=_answer_text(answers), distractors=tuple(distractors))


def _vt(task, length, seed, index, tok, haystack, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    n_vars = VT_HOPS + 1
    names = _distinct(rng, VT_CHAINS * n_vars, lambda r: _letters(r, 5, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    values = _distinct(rng, VT_CHAINS, lambda r: _number(r, 5))
    chains = [names[c * n_vars:(c + 1) * n_vars] for c in range(VT_CHAINS)]
    statements = [[f" VAR {chain[0]} = {value}."] + [f" VAR {chain[j]} = VAR {chain[j - 1]}." for j in range(1, n_vars)]
                  for chain, value in zip(chains, values)]
    order = rng.permutation(np.repeat(np.arange(VT_CHAINS), n_vars))  # a random interleaving, each chain in order
    nxt = [0] * VT_CHAINS
    flat = []
    for c in order:
        flat.append(statements[c][nxt[c]])
        nxt[c] += 1
    if depths is None:
        depths = sorted(rng.choice(MULTI_DEPTHS, len(flat), replace=False).tolist())
    question = TEMPLATES["vt_question"].format(value=values[0], n=n_vars)
    return _needle_item(
        task, length, seed, index, tok, haystack, rng, prefix=TEMPLATES["vt_prefix"], needles=flat,
        depths=list(depths), question=question, gen_tokens=answer_budget(tok, length),
        answers=tuple(chains[0]), gold=_answer_text(chains[0]),
        distractors=tuple(_answer_text(chain) for chain in chains[1:]))


CWE_SETTINGS = ((10, 30, 3), (10, 6, 1), (5, 4, 1))  # (common words, repeats of each, repeats of each other word)


def _cwe_budget(tok, length: int, n_common: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(prefix ids, question ids, answer tokens, tokens left for the list) of cwe with ``n_common`` words."""
    prefix_ids = _encode(tok, TEMPLATES["cwe_prefix"])
    question_ids = _encode(tok, TEMPLATES["cwe_question"].format(n=n_common))
    gen_tokens = _gen_budget(_answer_text(["x" * CWE_MAX_WORD] * n_common))
    return prefix_ids, question_ids, gen_tokens, length - len(prefix_ids) - len(question_ids) - gen_tokens


def cwe_setting(tok, length: int) -> tuple[int, int, int]:
    """The richest of ``CWE_SETTINGS`` whose common words' entries take at most half of the list's
    tokens (entries costed at their mean over the word list): RULER's (10 x 30, others x 3) from 4K
    tokens on, its short-context (10 x 6, x 1) below, (5 x 4, x 1) for the shortest lengths (or a
    byte-level tokenizer's long entries). A function of (tokenizer, length): every item agrees."""
    key = (tok.fingerprint, length)
    if key not in _CWE_SETTING:
        entry = (np.mean([len(x) for x in _pieces(tok, "words", 0)])
                 + np.mean([len(x) for x in _pieces(tok, "numbers", 1000)[:1000]]))
        fits = [s for s in CWE_SETTINGS[0 if length >= 4096 else 1:]
                if s[0] * s[1] * entry <= _cwe_budget(tok, length, s[0])[3] / 2]
        _CWE_SETTING[key] = fits[0] if fits else CWE_SETTINGS[-1]
    return _CWE_SETTING[key]


_CWE_SETTING: dict[tuple, tuple[int, int, int]] = {}


def answer_budget(tok, length: int) -> int:
    """Tokens reserved after every prompt at ``length`` (``Item.gen_tokens``): the bound of the longest
    answer any task may need there (cwe's), the same for every task, so that one compiled generation
    and one compiled forward pass serve all tasks at a length."""
    longest = [_answer_text(["0" * 7] * 4), _answer_text(["X" * 5] * (VT_HOPS + 1)),
               _answer_text(["x" * FWE_WORD_LEN] * FWE_ANSWERS),
               _answer_text(["x" * CWE_MAX_WORD] * cwe_setting(tok, length)[0])]
    return max(_gen_budget(a) for a in longest)


def _cwe(task, length, seed, index, tok, haystack=None, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    n_common, rep_common, rep_other = cwe_setting(tok, length)
    vocab = words()
    word_ids = _pieces(tok, "words", 0)
    order = rng.permutation(len(vocab))
    common, pool = order[:n_common], order[n_common:]
    prefix_ids, question_ids, _, _ = _cwe_budget(tok, length, n_common)
    gen_tokens = answer_budget(tok, length)
    budget = length - len(prefix_ids) - len(question_ids) - gen_tokens
    numbers = _pieces(tok, "numbers", max(budget, 1))
    num_cost = np.concatenate([[0], np.cumsum([len(x) for x in numbers])])

    def cost(entries: int, word_tokens: int) -> int:
        return int(num_cost[entries]) + word_tokens

    word_tokens = rep_common * sum(len(word_ids[w]) for w in common)
    entries, n_other = n_common * rep_common, 0
    while n_other < len(pool):  # as many other words as fit
        more = rep_other * len(word_ids[pool[n_other]])
        if cost(entries + rep_other, word_tokens + more) > budget:
            break
        word_tokens, entries, n_other = word_tokens + more, entries + rep_other, n_other + 1
    if n_other < n_common or cost(entries, word_tokens) > budget:
        raise TooShort(f"{task} at {length} tokens leaves room for {n_other} other words, fewer than the "
                       f"{n_common} the distractors need (template and answer take {length - budget} tokens)")
    if n_other == len(pool):
        raise TooShort(f"{task}: {len(vocab):,} words are too few to fill {length} tokens")
    others = pool[:n_other]
    listed = rng.permutation(np.concatenate([np.repeat(common, rep_common), np.repeat(others, rep_other)]))
    pieces = [prefix_ids]
    for i, w in enumerate(listed):
        pieces += [numbers[i], word_ids[w]]
    gap = budget - cost(entries, word_tokens)
    fresh = iter(pool[n_other:])
    k = len(listed)  # entries so far
    while gap > 0:  # words listed once (not counted in any answer), the last one cut to fit exactly
        k += 1
        number = numbers[k - 1] if k <= len(numbers) else _encode(tok, f" {k}.")
        entry = np.concatenate([number, word_ids[next(fresh)]])[:gap]
        pieces.append(entry)
        gap -= len(entry)
    pieces.append(question_ids)
    first = {}
    for w in listed:
        first.setdefault(int(w), len(first))
    in_order = lambda ws: sorted((int(w) for w in ws), key=first.__getitem__)  # noqa: E731
    gold = [vocab[w] for w in in_order(common)]
    distractors = [_answer_text([vocab[w] for w in in_order(rng.choice(others, n_common, replace=False))])
                   for _ in range(N_DISTRACTORS)]
    return Item(task, length, seed, index, None, np.concatenate(pieces).astype(np.int32), gen_tokens,
                answers=tuple(gold), gold=_answer_text(gold), distractors=tuple(distractors))


def zipf_counts(n_words: int, vocab_size: int, alpha: float = FWE_ALPHA) -> np.ndarray:
    """Occurrences of each of ``vocab_size`` ranked words among ~``n_words``: floor(n k^-alpha / Z)."""
    w = np.arange(1, vocab_size + 1, dtype=np.float64) ** -alpha
    return np.floor(n_words * w / w.sum()).astype(np.int64)


def _fwe(task, length, seed, index, tok, haystack=None, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    prefix_ids, question_ids = _encode(tok, TEMPLATES["fwe_prefix"]), _encode(tok, TEMPLATES["fwe_question"])
    gen_tokens = answer_budget(tok, length)
    budget = length - len(prefix_ids) - len(question_ids) - gen_tokens
    vocab_size = max(budget // 50, FWE_ANSWERS + 1 + N_DISTRACTORS + 1)  # RULER: max_seq_length // 50
    coded = ["..."] + _distinct(rng, vocab_size - 1, lambda r: _letters(r, FWE_WORD_LEN, "abcdefghijklmnopqrstuvwxyz"))
    word_ids = [np.asarray(x, np.int32) for x in tok.encode_batch([" " + w for w in coded])]
    costs = np.array([len(x) for x in word_ids], np.int64)
    lo, hi = 0, 4 * max(budget, 0) + 4 * vocab_size  # the most words whose encodings fit the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(zipf_counts(mid, vocab_size) @ costs) <= budget else (lo, mid - 1)
    counts = zipf_counts(lo, vocab_size)
    ranked = counts[1:FWE_ANSWERS + 2]  # the answers and the next word
    rarer = [k for k in range(FWE_ANSWERS + 2, vocab_size) if counts[k] > 0]
    if budget <= 0 or not np.all(np.diff(ranked) < 0) or len(rarer) < FWE_ANSWERS:
        raise TooShort(f"{task} at {length} tokens: {lo} coded words do not rank {FWE_ANSWERS} words strictly "
                       f"above the rest with {FWE_ANSWERS} rarer ones for distractors; use a longer length")
    listed = rng.permutation(np.repeat(np.arange(vocab_size), counts))
    pieces = [prefix_ids] + [word_ids[k] for k in listed]
    gap = budget - int(counts @ costs)
    if gap:  # dots after the first "...", which the question says to ignore
        first = 1 + int(np.flatnonzero(listed == 0)[0])
        pieces.insert(first + 1, np.full(gap, _single_token(tok, "."), np.int32))
    pieces.append(question_ids)
    gold = coded[1:FWE_ANSWERS + 1]
    distractors = [_answer_text([coded[k] for k in sorted(rng.choice(rarer, FWE_ANSWERS, replace=False))])
                   for _ in range(N_DISTRACTORS)]
    return Item(task, length, seed, index, None, np.concatenate(pieces).astype(np.int32), gen_tokens,
                answers=tuple(gold), gold=_answer_text(gold), distractors=tuple(distractors))


_GENERATORS = {**{t: _niah for t in NIAH}, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


def make_item(task: str, length: int, seed: int, index: int, tok, haystack: Haystack | None = None,
              depths=None) -> Item:
    """Item ``index`` of ``task`` at ``length`` tokens of ``tok`` (a pure function of its arguments).
    ``haystack`` is needed by the needle tasks (``HAYSTACK_TASKS``); ``depths`` (one per needle, in
    [0, 1], non-decreasing) overrides where the needles go. Raises :class:`TooShort` when ``length``
    leaves no room for the task."""
    if task not in _GENERATORS:
        raise ConfigError(f"unknown RULER task {task!r}; tasks: {', '.join(TASKS)}")
    if task in HAYSTACK_TASKS and haystack is None:
        raise ConfigError(f"{task} needs a haystack ({', '.join(HAYSTACKS)})")
    item = _GENERATORS[task](task, length, seed, index, tok, haystack if task in HAYSTACK_TASKS else None, depths)
    if len(item.ids) != length - item.gen_tokens:
        raise AssertionError(f"{task}: {len(item.ids)} prompt tokens, expected {length - item.gen_tokens}")
    longest = max(len(tok.encode(x)) for x in (item.gold, *item.distractors))
    if longest > item.gen_tokens:
        raise ConfigError(f"the tokenizer {tok.spec!r} encodes a {task} answer in {longest} tokens, more than "
                          f"its UTF-8 bytes + 2 ({item.gen_tokens}): not supported")
    return item


# ----------------------------------------------------------------------------- the cache


def cache_key(task: str, length: int, seed: int, tok, haystack: Haystack | None) -> dict:
    """What an item depends on besides its index (the generator's version, the word list's source)."""
    return {"version": GENERATOR_VERSION, "task": task, "length": int(length), "seed": int(seed),
            "tokenizer": tok.fingerprint, "words": essays_identity(),
            "haystack": haystack.identity if task in HAYSTACK_TASKS and haystack else None}


def cache_path(key: dict, root: Path | None = None) -> Path:
    from hybrid_lm.data.corpus import data_root
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or data_root() / "ruler") / f"{key['task']}-{key['length']}-{digest}.jsonl"


def _read_cache(path: Path, key: dict) -> list[Item]:
    """The cached items of ``key`` (index 0, 1, ...), or [] when absent, foreign or unreadable."""
    if not path.is_file():
        return []
    try:
        lines = path.read_text().splitlines()
        if not lines or json.loads(lines[0]).get("ruler_items") != key:
            return []
        items = [Item.from_json(json.loads(line)) for line in lines[1:] if line.strip()]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("unreadable RULER item cache %s (%s); generating the items again", path, e)
        return []
    good = []
    for i, item in enumerate(items):
        if item.index != i or len(item.ids) + item.gen_tokens != key["length"]:
            break
        good.append(item)
    return good


def load_items(task: str, length: int, seed: int, samples: int, tok, haystack: Haystack | None = None,
               root: Path | None = None) -> tuple[list[Item], Path]:
    """Items 0 .. samples - 1 of (task, length, seed) in ``tok``'s ids, from the cache under
    ``data_cache/ruler/`` (or ``root``), generating and caching the missing ones. Returns (items,
    cache file). A cache that cannot be written is a warning, not an error."""
    from hybrid_lm.files import atomic_write_text

    key = cache_key(task, length, seed, tok, haystack)
    path = cache_path(key, root)
    items = _read_cache(path, key)
    if len(items) >= samples:
        return items[:samples], path
    items += [make_item(task, length, seed, i, tok, haystack) for i in range(len(items), samples)]
    text = "\n".join([json.dumps({"ruler_items": key})] + [json.dumps(it.to_json()) for it in items]) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as e:
        log.warning("could not cache the RULER items in %s (%s)", path, e.strerror or e)
    return items, path


# ----------------------------------------------------------------------------- scoring (pure)


def string_match_all(continuation: str, answers) -> float:
    """Fraction of ``answers`` that occur in ``continuation``, case-insensitively (RULER's metric)."""
    text = continuation.lower()
    return sum(a.lower() in text for a in answers) / len(answers)


def answer_scores(gold_nll: np.ndarray, distractor_nll=()) -> dict:
    """``{"nll", "win"}`` of one item: the gold answer's mean NLL per token (``gold_nll``: NLL of
    each of its tokens) and whether its log-likelihood (the sum) is above every distractor's (None
    without distractors)."""
    gold_nll = np.asarray(gold_nll, np.float64)
    sums = [float(np.sum(d)) for d in distractor_nll]
    win = None if not sums else bool(float(gold_nll.sum()) < min(sums))
    return {"nll": float(gold_nll.mean()), "win": win}


def summarize(items: list[Item], exact: list[float] | None, scores: list[dict]) -> dict:
    """A (task, length)'s scores over its items: exact match (None without generation), mean answer
    NLL, and the gold-beats-distractors rate with its chance level (None without distractors)."""
    wins = [s["win"] for s in scores if s["win"] is not None]
    n_d = len(items[0].distractors)
    return {"exact_match": None if exact is None else float(np.mean(exact)),
            "answer_nll": float(np.mean([s["nll"] for s in scores])),
            "ll_accuracy": float(np.mean(wins)) if wins else None,
            "ll_chance": 1.0 / (1 + n_d) if n_d else None, "distractors": n_d,
            "per_item": {"depth": [list(it.depths) for it in items], "exact": exact,
                         "nll": [round(s["nll"], 5) for s in scores], "win": [s["win"] for s in scores]}}


# ----------------------------------------------------------------------------- the model side


def parse_lengths(text: str, flag: str = "--lengths") -> list[int]:
    """"4K,8192,16k" -> [4096, 8192, 16384]; errors name ``flag``, the option the text came from
    (``hybrid-lm ruler --lengths``, ``hybrid-lm eval --ruler-lengths``)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m or int(m.group(1)) == 0:
            raise ConfigError(f"{flag}: {part!r} is not a positive length in tokens (e.g. 4096 or 4K)")
        out.append(int(m.group(1)) * (1024 if m.group(2) else 1))
    if not out:
        raise ConfigError(f"{flag}: give at least one length")
    return out


def check_request(cfg, tasks=None, lengths=None, haystack: str = "essays", allow_longer: bool = False,
                  samples: int = 1, lengths_flag: str = "--lengths") -> tuple[list[str], list[int]]:
    """The tasks and lengths to run for the run config ``cfg``, checked before anything is restored:
    known tasks and haystack, lengths up to the run's seq_len unless ``allow_longer`` (default: RULER's
    4K..32K that fit, else the seq_len). ``lengths_flag``: the option the lengths came from, for errors."""
    tasks = list(dict.fromkeys(tasks or TASKS))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ConfigError(f"unknown RULER task(s) {', '.join(map(repr, unknown))}; tasks: {', '.join(TASKS)}")
    if haystack not in HAYSTACKS:
        raise ConfigError(f"--haystack {haystack!r}: choose one of {', '.join(HAYSTACKS)}")
    if samples < 1:
        raise ConfigError(f"--samples {samples}: need at least 1")
    seq_len = cfg.data.seq_len
    if lengths is None:
        lengths = [n for n in DEFAULT_LENGTHS if n <= seq_len] or [seq_len]
    lengths = sorted(set(int(n) for n in lengths))
    too_long = [n for n in lengths if n > seq_len]
    if too_long and not allow_longer:
        raise ConfigError(f"length(s) {', '.join(map(str, too_long))} exceed the run's seq_len {seq_len}: use "
                          f"shorter {lengths_flag}, or --allow-longer to evaluate beyond the trained length")
    return tasks, lengths


def decode_unavailable(model) -> str | None:
    """Why ``model`` cannot generate token by token (a mixer without a decode path), or None."""
    for i, block in enumerate(model.blocks):
        try:
            block.check_decode(i)
        except NotImplementedError as e:
            return str(e).split(";")[0]
    return None


def tokens_seen(run) -> int:
    """Tokens the restored checkpoint was trained on: its saved metadata, else step x batch x seq_len."""
    meta = run.workdir / "checkpoints" / str(run.step) / "meta" / "metadata"
    try:
        return int(json.loads(meta.read_text())["tokens_seen"])
    except (OSError, ValueError, KeyError, TypeError):
        return run.step * run.cfg.train.global_batch * run.cfg.data.seq_len


def _answer_nll_fn(fns, cfg, span: int):
    """Jitted ``(params, tokens [B, L]) -> [B, span]``: NLL of the last ``span`` tokens given their
    prefixes, eval mode; logits only for those positions."""
    import jax
    import jax.numpy as jnp

    from hybrid_lm.model.registry import MixerContext
    from hybrid_lm.ops.attention import default_positions

    def nll(params, tokens):
        B, L = tokens.shape
        ctx = MixerContext(positions=default_positions(B, L), attention_impl=cfg.model.attention_impl,
                           seed=cfg.train.seed, train=False)
        model = fns.model(params)
        h = model(tokens, ctx, features=True)[:, L - span - 1:L - 1]
        logits = (h @ model.head_matrix().astype(h.dtype)).astype(jnp.float32)
        target = tokens[:, L - span:]
        return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0]
    return jax.jit(nll)


def _batches(rows: np.ndarray, per: int):
    """``rows`` in batches of exactly ``per`` (the last one padded by repeating its first row), with
    how many rows of each are real."""
    for i in range(0, len(rows), per):
        part = rows[i:i + per]
        n = len(part)
        if n < per:
            part = np.concatenate([part, np.repeat(part[:1], per - n, axis=0)])
        yield part, n


def batch_rows(run, length: int, n_rows: int, batch_size: int | None = None) -> int:
    """Rows per forward pass at ``length``: ``batch_size``, else the trainer's tokens per step at this
    length, at most the rows there are; a multiple of the batch shards."""
    shards = run.n_batch_shards
    per = batch_size or max(1, run.cfg.train.global_batch * run.cfg.data.seq_len // length)
    per = min(per, n_rows)
    return max(shards, -(-per // shards) * shards)


def evaluate_ruler(run, *, tasks=None, lengths=None, samples: int = 8, haystack: str = "essays", seed: int = 0,
                   allow_longer: bool = False, batch_size: int | None = None, cfg=None, cache_root=None,
                   progress: bool = True, lengths_flag: str = "--lengths") -> tuple[list[dict], list[dict]]:
    """RULER on ``run`` (a :class:`~hybrid_lm.eval.restore.RestoredRun`) with the model of ``cfg``
    (default the run's; a swapped config of the same parameters works): ``(rows, skipped)``, a row
    per (task, length) evaluated (``kind: ruler``, ``task: ruler/<name>``, scores, settings) and a
    ``{task, length, reason}`` per pair too short to generate (``lengths_flag``: the option the lengths
    came from, named by errors). Nothing is recorded here."""
    import jax
    from tqdm import tqdm

    from hybrid_lm.backends import recorded_backends
    from hybrid_lm.eval.generate import generate
    from hybrid_lm.eval.swap import describe
    from hybrid_lm.progress import bar_disabled
    from hybrid_lm.train.sharding import put_batch
    from hybrid_lm.train.step import ModelFns

    cfg = cfg or run.cfg
    tasks, lengths = check_request(cfg, tasks, lengths, haystack, allow_longer, samples, lengths_flag)
    t_all = time.time()
    tok = run.tokenizer
    hay = haystack_for(haystack, tok, run) if any(t in HAYSTACK_TASKS for t in tasks) else None
    fns = run.fns if cfg is run.cfg else ModelFns(cfg)
    model = fns.model(run.params)
    no_decode = decode_unavailable(model)
    impl = cfg.model.attention_impl
    common = {"kind": "ruler", "step": run.step, "checkpoint_step": run.step, "tokens_seen": tokens_seen(run),
              "run_id": run_id(run.cfg), "seed": seed, "samples": samples,
              "trained_seq_len": run.cfg.data.seq_len, "generation": "greedy" if no_decode is None else
              f"unavailable ({no_decode}): log-likelihood scores only",
              "layer_types": "".join(cfg.model.layer_types()), "mixers": describe(cfg.model),
              "attention_impl": impl, "devices": int(run.mesh.devices.size)}
    rows, skipped = [], []
    recorded_backends(clear=True)
    for length in lengths:
        sets = {}
        for task in tasks:
            try:
                sets[task] = load_items(task, length, seed, samples, tok, hay, cache_root)
            except TooShort as e:
                skipped.append({"task": task, "length": length, "reason": str(e)})
        if not sets:
            continue
        span = max(items[0].gen_tokens for items, _ in sets.values())
        nll_fn = _answer_nll_fn(fns, cfg, span)
        for task, (items, path) in sets.items():
            t0 = time.time()
            G = items[0].gen_tokens
            P = length - G
            conts = [[_encode(tok, it.gold)] + [_encode(tok, d) for d in it.distractors] for it in items]
            flat = [(i, j) for i, c in enumerate(conts) for j in range(len(c))]
            seqs = np.zeros((len(flat), length), np.int32)
            for r, (i, j) in enumerate(flat):
                seqs[r, :P] = items[i].ids
                seqs[r, P:P + len(conts[i][j])] = conts[i][j]
            # one batch shape per length (tasks have 0 to N_DISTRACTORS distractors): one compile each
            per_ll = batch_rows(run, length, samples * (1 + N_DISTRACTORS), batch_size)
            per_gen = batch_rows(run, length, samples, batch_size)
            n_gen = 0 if no_decode else -(-len(items) // per_gen)
            bar = tqdm(total=n_gen + -(-len(flat) // per_ll), desc=f"ruler {task} {length}", unit="batch",
                       disable=bar_disabled(progress), leave=False)
            exact = None
            with jax.set_mesh(run.mesh):
                if no_decode is None:
                    exact = []
                    prompts = np.stack([it.ids for it in items])
                    for part, n in _batches(prompts, per_gen):
                        out = np.asarray(generate(model, put_batch(part, run.batch_shard), G, attention_impl=impl))
                        base = len(exact)
                        exact += [string_match_all(tok.decode(out[k]), items[base + k].answers) for k in range(n)]
                        bar.update()
                nll = []
                for part, n in _batches(seqs, per_ll):
                    nll.append(np.asarray(nll_fn(run.params, put_batch(part, run.batch_shard)))[:n])
                    bar.update()
            bar.close()
            nll = np.concatenate(nll)[:, span - G:]  # position k: answer token k
            per_item = [[] for _ in items]
            for r, (i, j) in enumerate(flat):
                per_item[i].append(nll[r, :len(conts[i][j])])
            scores = [answer_scores(p[0], p[1:]) for p in per_item]
            rows.append({**common, "task": f"ruler/{task}", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "length": length, "prompt_tokens": P, "gen_tokens": G,
                         "haystack": hay.name if task in HAYSTACK_TASKS else None,
                         **summarize(items, exact, scores), "items_cache": str(path),
                         "wall_s": round(time.time() - t0, 3)})
    backends = recorded_backends()
    for r in rows:
        r["attention_backends"] = backends
    log.info("ruler: %d rows in %.1f s", len(rows), time.time() - t_all)
    return rows, skipped


def format_table(rows: list[dict], skipped: list[dict] = ()) -> str:
    """Tasks x lengths: exact match, answer NLL (nats/token) and gold-beats-distractors (chance in
    brackets); "—" where a score does not apply, "short" where the length was too short."""
    if not rows and not skipped:
        return "no RULER results"
    lengths = sorted({r["length"] for r in rows} | {s["length"] for s in skipped})
    tasks = [t for t in TASKS if any(r["task"] == f"ruler/{t}" for r in rows) or any(s["task"] == t for s in skipped)]
    cell = {(r["task"][len("ruler/"):], r["length"]): r for r in rows}
    short = {(s["task"], s["length"]) for s in skipped}

    def fmt(task, length, what):
        if (task, length) in short:
            return "short"
        r = cell.get((task, length))
        if r is None:
            return ""
        if what == "ll":
            return "—" if r["ll_accuracy"] is None else f"{r['ll_accuracy']:.2f} ({r['ll_chance']:.2f})"
        v = r[what]
        return "—" if v is None else f"{v:.3f}"

    lines = []
    first = rows[0] if rows else {}
    if first:
        hay = next((r["haystack"] for r in rows if r["haystack"]), None)
        lines.append(f"RULER  step {first['checkpoint_step']}  {first['samples']} samples  seed {first['seed']}"
                     + (f"  haystack {hay}" if hay else "") + f"  generation: {first['generation']}")
    width = max(14, *(len(str(L)) for L in lengths))
    for title, what in (("exact match (greedy)", "exact_match"), ("answer NLL (nats/token)", "answer_nll"),
                        ("gold beats distractors (chance)", "ll")):
        lines.append(title)
        lines.append(f"  {'task':<16}" + "".join(f"{L:>{width}}" for L in lengths))
        for t in tasks:
            lines.append(f"  {t:<16}" + "".join(f"{fmt(t, L, what):>{width}}" for L in lengths))
    for s in skipped:
        lines.append(f"short: {s['reason']}")
    return "\n".join(lines)


__all__ = ["HAYSTACKS", "TASKS", "Haystack", "Item", "TooShort", "answer_scores", "check_request", "evaluate_ruler",
           "format_table", "haystack_for", "load_items", "make_item", "parse_lengths", "string_match_all",
           "summarize"]

"""RULER-offline's items (Hsieh et al. 2024, NVIDIA/RULER at c3f5e3b): synthetic long-context tasks,
generated here with no download as RULER's generators build them, with RULER's constants and templates;
``eval/ruler.py`` scores a checkpoint on them.

Tasks (``TASKS``; docs/EVAL.md has the comparison with RULER line by line):

- ``niah_single`` / ``niah_multikey`` / ``niah_multivalue`` / ``niah_multiquery``: RULER's
  niah_single_2, niah_multikey_1, niah_multivalue, niah_multiquery: needles "One of the special
  magic numbers for {key} is: {value}." in the essays, at depths drawn from RULER's 40-point grid
  (sentence index ``int(n * depth / 100)``), or at random lines of the noise haystack; RULER's
  templates (``RULER_TEMPLATES``, the base model template with the answer prefix).
- ``vt``: variable tracking, one chain of four hops (``VAR A = 12345`` then ``VAR B = VAR A`` ...)
  at random lines of the noise haystack, after RULER's one-shot example (:func:`vt_example`).
- ``cwe``: common-word extraction: a numbered list where a few words repeat much more often than
  the rest, after a one-shot example; asked for the most common ones.
- ``fwe``: frequent-word extraction: coded words drawn from a Zipf law (``int(n k^-2 / zeta(2))``;
  the most frequent is "...", noise); asked for the three most frequent coded words.

Haystacks for the needle tasks: each task's RULER haystack by default (``RULER_HAYSTACK``: essays
for the NIAH tasks, noise for vt), or one for all (``essays``, the embedded Paul Graham essays from
their first sentence on; ``corpus``, the run's token store, val split, decoded; ``noise``, RULER's
line "The grass is green. ..." repeated). ``cwe`` and ``fwe`` are their own haystack.

Items. :func:`make_item` is a pure function of (task, length, seed, index, tokenizer, haystack):
a prompt of exactly ``length - gen_tokens`` token ids of the run's tokenizer (the haystack's last
unit cut at its end to fill it), so prompt plus generation is ``length`` tokens and every item of
a (task, length) has one shape (batched, one compile). ``gen_tokens`` (:func:`answer_budget`) is
RULER's largest ``tokens_to_generate`` (128) or the bound of the longest answer if larger, the same
for every task at a length, so one compiled generation and one compiled forward pass serve all tasks
of a length. :func:`load_items` caches items under ``data_cache/ruler/`` keyed by (generator
version, task, length, seed, tokenizer fingerprint, haystack identity).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import re
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.special import zeta

from hybrid_lm.data.corpus import data_root
from hybrid_lm.data.sources import embedded_documents
from hybrid_lm.errors import ConfigError
from hybrid_lm.files import atomic_write_text

log = logging.getLogger(__name__)

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
HAYSTACK_TASKS = frozenset({"niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"})
HAYSTACKS = ("essays", "corpus", "noise")
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768)
GENERATOR_VERSION = 2  # bump when an item for the same key would change (invalidates the cache)

# The official sources transcribed below: NVIDIA/RULER at c3f5e3b (scripts/data/synthetic/*.py,
# scripts/data/synthetic/constants.py, scripts/synthetic.yaml).
MIN_HAYSTACK = 16  # tokens of haystack an item needs, at least
CORPUS_TOKENS = 4_000_000  # the corpus haystack: the val split's first documents up to this many tokens
# niah.py / variable_tracking.py: DEPTHS, the needle depths in percent of the haystack's sentences
DEPTHS = tuple(int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int))
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")
# synthetic.yaml: each task's haystack (niah_single_2, multikey_1, multivalue, multiquery: essays; vt: noise)
RULER_HAYSTACK = {"niah_single": "essays", "niah_multikey": "essays", "niah_multivalue": "essays",
                  "niah_multiquery": "essays", "vt": "noise"}

# (keys, values per key, keys asked) of each NIAH task (RULER's niah_single_2, multikey_1, multivalue, multiquery)
NIAH = {"niah_single": (1, 1, 1), "niah_multikey": (4, 1, 1), "niah_multivalue": (1, 4, 1),
        "niah_multiquery": (4, 1, 4)}
VT_CHAINS, VT_HOPS = 1, 4  # synthetic.yaml vt: num_chains 1, num_hops 4
# the tasks whose items carry distractors, so that the gold answer can be ranked against them by log-likelihood
# (NIAH: the keys not asked; vt: the other chains; cwe, fwe: other words of the context)
LL_TASKS = frozenset({t for t, (keys, _, asked) in NIAH.items() if keys > asked}
                     | ({"vt"} if VT_CHAINS > 1 else set()) | {"cwe", "fwe"})
VT_ICL_TOKENS = 500  # variable_tracking.py main(): the one-shot example is built for max_seq_length=500
FWE_ALPHA, FWE_WORD_LEN, FWE_ANSWERS = 2.0, 6, 3
CWE_MAX_WORD = 10
N_DISTRACTORS = 3  # cwe and fwe: alternative answers scored against the gold one

# constants.py: tokens_to_generate per task family; generation stops there or at EOS
TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
GEN_TOKENS = max(TOKENS_TO_GENERATE.values())

# constants.py TASKS[...]["template"] + ["answer_prefix"] (the base model template: prepare.py appends the
# answer prefix to the task template; the generators then format it)
RULER_TEMPLATES = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
             "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
             "{type_needle_v} for {query} mentioned in the provided text?"
             " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
           "Question: Find all variables that are assigned the value {query} in the text above."
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
           "assigned the value {query}, they are: "),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
            "list? Answer: The top 10 words that appear most often in the list are:"),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
            "the dots '....'. What are the three most frequently appeared words in the above coded text?"
            " Answer: According to the coded text above, the three most frequently appeared words are:"),
}
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."  # niah.py


def niah_template(n_answers: int) -> tuple[str, str]:
    """``(template, type_needle_v)`` of a NIAH prompt with ``n_answers`` = num_needle_q * num_needle_v
    answers: niah.py's singular rewrite when there is one."""
    template, type_needle_v = RULER_TEMPLATES["niah"], "numbers"
    if n_answers == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        type_needle_v = type_needle_v[:-1]
    return template, type_needle_v


def split_template(template: str, **fields) -> tuple[str, str]:
    """``template`` formatted with ``fields``, split at ``{context}``: (before, after)."""
    before, after = template.format(context="\x00", **fields).split("\x00")
    return before, after


def family(task: str) -> str:
    """The RULER task family of ``task`` (``niah``, ``vt``, ``cwe``, ``fwe``)."""
    return "niah" if task.startswith("niah") else task


class TooShort(ConfigError):
    """A (task, length) whose template, needles and answer leave no room for the task's content."""


# ----------------------------------------------------------------------------- items


@dataclasses.dataclass(frozen=True)
class Item:
    """One RULER prompt: ``ids`` (exactly ``length - gen_tokens`` token ids), the strings a correct
    answer contains (``answers``), the teacher-forced ``gold`` continuation and its ``distractors``,
    the needles' depths (fraction of the haystack's units before each) and token spans ``[start, end)``."""

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


def encode(tok, text: str) -> np.ndarray:
    """``text`` in ``tok``'s ids (int32)."""
    return np.asarray(tok.encode(text), np.int32)


def _gen_budget(longest_answer: str) -> int:
    """Tokens an answer may take: its UTF-8 bytes + 2 bound its token count for the byte
    tokenizer, byte-level BPE and SentencePiece (a dummy-prefix piece) on ASCII text."""
    return len(longest_answer.encode("utf-8")) + 2


def _answer_text(words) -> str:
    return " " + ", ".join(words) + "."


def _numbered(words) -> str:
    """cwe's answer as its one-shot example gives it: `` 1. word 2. word ...``."""
    return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


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
    """niah.py generate_random_number: uniform in [10^(digits-1), 10^digits - 1]."""
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _letters(rng, k: int, alphabet: str) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), k))


UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# ----------------------------------------------------------------------------- words and haystacks


@lru_cache(maxsize=1)
def essay_texts() -> tuple[tuple[str, str], ...]:
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
    """The filler text of the needle tasks as units joined by ``sep``: the essays' (or the corpus')
    sentences joined by spaces, or RULER's noise lines joined by newlines. ``units`` holds each unit
    encoded after its separator, ``bare`` encoded alone (the context's first piece), ``texts`` the text."""

    name: str
    identity: str  # what the items' cache key records
    sep: str
    texts: tuple[str, ...]
    units: tuple[np.ndarray, ...]
    bare: tuple[np.ndarray, ...]

    @property
    def lines(self) -> bool:
        """Needles go to random lines (RULER's noise haystack), not to a depth of the sentences."""
        return self.sep == "\n"

    def count(self, n_tokens: int, start: int = 0) -> int:
        """How many units from ``start`` on (wrapping, the first bare) reach ``n_tokens`` tokens."""
        total, k = 0, 0
        while total < n_tokens:
            total += len((self.units if k else self.bare)[(start + k) % len(self.units)])
            k += 1
        return k

    def fill(self, n_tokens: int, start: int = 0) -> list[np.ndarray]:
        """Units from ``start`` on (wrapping, the first bare) totalling exactly ``n_tokens`` ids: the last
        one cut at its end (RULER's essay haystack, the first words of the essays, ends mid-sentence)."""
        k = self.count(n_tokens, start)
        out = [(self.units if i else self.bare)[(start + i) % len(self.units)] for i in range(k)]
        excess = sum(map(len, out)) - n_tokens
        if excess:
            out[-1] = out[-1][:len(out[-1]) - excess]
        return out


_HAYSTACKS: dict[tuple, Haystack] = {}


def _haystack(name: str, identity: str, tok, sep: str, texts) -> Haystack:
    key = (identity, tok.fingerprint)
    if key not in _HAYSTACKS:
        texts = [t for t in texts() if t]
        if not texts:
            raise ConfigError(f"the {name} haystack holds no text")
        units = [np.asarray(ids, np.int32) for ids in tok.encode_batch([sep + t for t in texts])]
        bare = [np.asarray(ids, np.int32) for ids in tok.encode_batch(texts)]
        keep = [i for i in range(len(texts)) if len(units[i]) and len(bare[i])]
        _HAYSTACKS[key] = Haystack(name, identity, sep, tuple(texts[i] for i in keep), tuple(units[i] for i in keep),
                                   tuple(bare[i] for i in keep))
    return _HAYSTACKS[key]


def essays_haystack(tok) -> Haystack:
    return _haystack("essays", essays_identity(), tok, " ",
                     lambda: [s for _, text in essay_texts() for s in split_sentences(text)])


def noise_haystack(tok) -> Haystack:
    """RULER's noise: the line of five sentences, repeated, one per line."""
    return _haystack("noise", "noise-lines", tok, "\n", lambda: [NOISE_LINE])


def corpus_haystack(tok, store) -> Haystack:
    """The val split of ``store`` (a :class:`~hybrid_lm.data.store.TokenStore` of ``tok``), decoded
    document by document (its first documents, up to ``CORPUS_TOKENS`` tokens), in sentences."""
    if store.tokenizer.get("fingerprint") != tok.fingerprint:
        raise ConfigError(f"token store {store.path} was prepared with another tokenizer than the run's")
    view = store.split("val")
    if view.n_docs == 0:
        raise ConfigError(f"token store {store.path} has no val documents: use --haystack essays or noise")

    def sentences():
        starts, used, out = view.doc_starts, 0, []
        for d in range(view.n_docs):
            n = int(min(starts[d + 1] - starts[d], CORPUS_TOKENS - used))
            out += split_sentences(tok.decode(view.read(int(starts[d]), n)))
            used += n
            if used >= CORPUS_TOKENS:
                break
        return out
    return _haystack("corpus", f"corpus:{store.fingerprint[:16]}", tok, " ", sentences)


def haystack_for(name: str, tok, run=None) -> Haystack:
    """The ``name`` haystack (one of ``HAYSTACKS``) in ``tok``'s ids; ``corpus`` needs the
    :class:`~hybrid_lm.run.restore.RestoredRun` whose token store it reads."""
    if name == "essays":
        return essays_haystack(tok)
    if name == "noise":
        return noise_haystack(tok)
    if name == "corpus":
        if run is None:
            raise ConfigError("the corpus haystack reads a run's token store: give the run")
        return corpus_haystack(tok, run.streams().store)
    raise ConfigError(f"--haystack {name!r}: choose one of {', '.join(HAYSTACKS)}")


def task_haystack(task: str, haystack: str | None) -> str | None:
    """The haystack ``task`` reads: ``haystack`` when given, else RULER's for the task (None for cwe, fwe)."""
    if task not in HAYSTACK_TASKS:
        return None
    return haystack or RULER_HAYSTACK[task]


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


def _assemble(haystack: Haystack, n_units: int, at, bare, pref, target: int):
    """The context: ``n_units`` haystack units with needle k (``bare[k]`` / ``pref[k]``: encoded alone /
    after the separator) before unit ``at[k]`` (``at`` non-decreasing; ``n_units``: after the last),
    the first piece encoded alone, the rest after their separator, the last unit cut at its end so the
    context is exactly ``target`` ids. Returns (ids, [(start, end)] of each needle within them), or
    None when the pieces fall short of ``target`` (then one more unit is needed)."""
    pieces, k = [], 0
    for b in range(n_units + 1):
        while k < len(at) and at[k] == b:
            pieces.append(["needle", k, pref[k] if pieces else bare[k]])
            k += 1
        if b < n_units:
            pieces.append(["unit", b, (haystack.units if pieces else haystack.bare)[b % len(haystack.units)]])
    excess = sum(len(p[2]) for p in pieces) - target
    if excess < 0:
        return None
    for p in reversed(pieces):  # cut the last unit(s) at their end
        if excess == 0:
            break
        if p[0] == "unit":
            cut = min(excess, len(p[2]))
            p[2], excess = p[2][:len(p[2]) - cut], excess - cut
    spans, pos = [], 0
    for p in pieces:
        if p[0] == "needle":
            spans.append((pos, pos + len(p[2])))
        pos += len(p[2])
    return np.concatenate([p[2] for p in pieces] or [np.zeros(0, np.int32)]).astype(np.int32), spans


def _needle_item(task, length, seed, index, tok, haystack: Haystack, *, prefix, needles, place, question,
                 gen_tokens, **fields) -> Item:
    """An item of a needle task: ``prefix``, the haystack with ``needles`` (texts, in text order) at the
    unit boundaries ``place(n_units)`` returns, ``question``; the haystack fills exactly what the rest
    and the answer leave."""
    prefix_ids, question_ids = encode(tok, prefix), encode(tok, question)
    bare = [encode(tok, n) for n in needles]
    pref = [encode(tok, haystack.sep + n) for n in needles]
    target = length - gen_tokens - len(prefix_ids) - len(question_ids)
    n_hay = target - sum(len(p) for p in pref)
    if n_hay < MIN_HAYSTACK:
        raise TooShort(f"{task} needs at least {length - n_hay + MIN_HAYSTACK} tokens with this tokenizer "
                       f"(template, needles and answer take {length - n_hay}); {length} is too short")
    n_units = haystack.count(n_hay)
    at = [int(a) for a in place(n_units)]
    built = None
    while built is None:
        built = _assemble(haystack, n_units, at, bare, pref, target)
        n_units += built is None
    context, spans = built
    ids = np.concatenate([prefix_ids, context, question_ids]).astype(np.int32)
    spans = tuple((len(prefix_ids) + a, len(prefix_ids) + b) for a, b in spans)
    placed = tuple(a / max(1, n_units) for a in at)
    return Item(task, length, seed, index, haystack.name, ids, gen_tokens, depths=placed, needle_spans=spans,
                **fields)


def depth_places(rng, k: int, depths=None):
    """``place`` for the sentence haystacks (niah.py, variable_tracking.py): the needles go before
    sentence ``int(n * depth / 100)`` for ``k`` depths drawn without replacement from :data:`DEPTHS`,
    sorted (or the given fractions ``depths``)."""
    drawn = sorted(int(d) for d in rng.choice(DEPTHS, k, replace=False)) if depths is None else None
    if depths is not None:
        return lambda n: [int(n * d) for d in sorted(depths)]
    return lambda n: [int(n * (d / 100)) for d in drawn]


def line_places(rng, k: int, depths=None):
    """``place`` for the noise haystack (niah.py, variable_tracking.py): ``k`` distinct random lines,
    sorted (or the given fractions ``depths``)."""
    if depths is not None:
        return lambda n: [int(n * d) for d in sorted(depths)]
    return lambda n: sorted(int(x) for x in rng.choice(n, min(k, n), replace=False)) + [n] * max(0, k - n)


def _niah(task, length, seed, index, tok, haystack, depths=None) -> Item:
    n_keys, n_values, n_queries = NIAH[task]
    rng = item_rng(task, length, seed, index)
    vocab = words()
    keys = [f"{vocab[rng.integers(len(vocab))]}-{vocab[rng.integers(len(vocab))]}" for _ in range(n_keys)]
    values = [[_number(rng, 7) for _ in range(n_values)] for _ in range(n_keys)]
    needles = [(k, v) for k, vs in zip(keys, values) for v in vs]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    asked = [int(i) for i in rng.choice(n_keys, n_queries, replace=False)]
    queries = [keys[i] for i in asked]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    template, type_needle_v = niah_template(n_queries * n_values)
    prefix, question = split_template(template, type_needle_v=type_needle_v, query=query)
    if haystack.lines:
        needles = needles[::-1]  # niah.py inserts them at descending line indexes: the last one first in the text
        place = line_places(rng, len(needles), depths)
    else:
        place = depth_places(rng, len(needles), depths)
    if n_values > 1:  # one key: its values in the order they appear in the text
        answers = [v for _, v in needles]
    else:
        answers = [values[i][0] for i in asked]
    distractors = [_answer_text([values[i][0]]) for i in range(n_keys) if i not in asked]
    return _needle_item(
        task, length, seed, index, tok, haystack, prefix=prefix, question=question, place=place,
        needles=[NEEDLE.format(type_needle_v="numbers", key=k, value=v) for k, v in needles],
        gen_tokens=answer_budget(tok, length),
        answers=tuple(answers), gold=_answer_text(answers), distractors=tuple(distractors))


def _vt_statements(chain: list[str], value: str, lines: bool) -> list[str]:
    """variable_tracking.py generate_chains: ``VAR A = 12345`` then ``VAR B = VAR A `` ... (with the
    trailing space), as lines of the noise haystack; sentences (stripped, a period added) in an essay."""
    out = [f"VAR {chain[0]} = {value}"] + [f"VAR {chain[j + 1]} = VAR {chain[j]} " for j in range(len(chain) - 1)]
    return out if lines else [s.strip() + "." for s in out]


def _vt_context(haystack: Haystack, n: int, statements: list[str], rng) -> str:
    """variable_tracking.py generate_input_output's context from ``n`` haystack units (from the first)."""
    if haystack.lines:
        lines = [haystack.texts[i % len(haystack.texts)] for i in range(n)]
        positions = sorted(int(x) for x in rng.choice(len(lines), len(statements), replace=False))
        for j, (p, s) in enumerate(zip(positions, statements)):
            lines.insert(p + j, s)
        return "\n".join(lines).replace(". \n", ".\n")
    sents = [haystack.texts[i % len(haystack.texts)] for i in range(n)]
    cuts = [0] + sorted(int(n * (d / 100)) for d in rng.choice(DEPTHS, len(statements), replace=False)) + [n]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
        if i - 1 < len(statements):
            parts.append(statements[i - 1])
    return " ".join(parts)


_VT_EXAMPLES: dict[tuple, tuple[str, int]] = {}


def vt_example(tok, haystack: Haystack, seed: int) -> str:
    """The one-shot example variable_tracking.py main() puts before every prompt: a whole vt prompt
    with a chain of 3-letter names holding 12345 in as many haystack units as keep it within
    :data:`VT_ICL_TOKENS` tokens, followed by its answer (`` NAMES...`` after the prompt's ``they are: ``)
    and a newline. Per seed and haystack (RULER: one per dataset); :func:`_randomize_example` renames
    its variables and value for each item."""
    key = (tok.fingerprint, haystack.identity, seed)
    if key not in _VT_EXAMPLES:
        rng = np.random.default_rng([seed, zlib.crc32(b"vt-icl")])
        names = _distinct(rng, VT_HOPS + 1, lambda r: _letters(r, 3, UPPER))
        statements = _vt_statements(names, "12345", haystack.lines)
        before, after = split_template(RULER_TEMPLATES["vt"], query="12345", num_v=VT_HOPS + 1)
        state = rng.bit_generator.state

        def text(n):
            rng.bit_generator.state = state  # the same draws for every n tried
            return before + _vt_context(haystack, n, statements, rng) + after

        lo = 5 if haystack.lines else 1  # variable_tracking.py: incremental 5 (noise) lines
        best, hi = lo, 4 * VT_ICL_TOKENS
        while lo <= hi:  # the most units within the budget (RULER's binary search)
            mid = (lo + hi) // 2
            if len(tok.encode(text(mid))) <= VT_ICL_TOKENS:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        _VT_EXAMPLES[key] = text(best) + " " + " ".join(names) + "\n"
    return _VT_EXAMPLES[key]


def _randomize_example(example: str, rng) -> str:
    """variable_tracking.py randomize_icl: the answer's names replaced by random capitals of their
    length (everywhere in the example), 12345 by a random value in [10000, 99999)."""
    for name in example.strip().split()[-(VT_HOPS + 1):]:
        example = example.replace(name, _letters(rng, len(name), UPPER))
    return example.replace("12345", str(int(rng.integers(10000, 99999))))


def _shuffle_sublists(rng, chains: list[list[str]]) -> list[str]:
    """variable_tracking.py shuffle_sublists_heap: the chains interleaved at random, each in order."""
    order = rng.permutation(np.repeat(np.arange(len(chains)), [len(c) for c in chains]))
    nxt = [0] * len(chains)
    out = []
    for c in order:
        out.append(chains[c][nxt[c]])
        nxt[c] += 1
    return out


def _vt(task, length, seed, index, tok, haystack, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    n_vars = VT_HOPS + 1
    names = _distinct(rng, VT_CHAINS * n_vars, lambda r: _letters(r, 5, UPPER))
    chains = [names[c * n_vars:(c + 1) * n_vars] for c in range(VT_CHAINS)]
    values = [str(int(rng.integers(10000, 99999))) for _ in chains]
    statements = [_vt_statements(chain, value, haystack.lines) for chain, value in zip(chains, values)]
    if haystack.lines:
        flat = [s for chain in statements for s in chain]
        place = line_places(rng, len(flat), depths)
    else:
        flat = _shuffle_sublists(rng, statements)
        place = depth_places(rng, len(flat), depths)
    example = _randomize_example(vt_example(tok, haystack, seed), rng)
    before, after = split_template(RULER_TEMPLATES["vt"], query=values[0], num_v=n_vars)
    return _needle_item(
        task, length, seed, index, tok, haystack, prefix=example + "\n" + before, needles=flat, place=place,
        question=after, gen_tokens=answer_budget(tok, length),
        answers=tuple(chains[0]), gold=" " + " ".join(chains[0]),
        distractors=tuple(" " + " ".join(chain) for chain in chains[1:]))


# (common words, repeats of each, repeats of each other word, one-shot example (words, repeats, repeats)):
# RULER's common_words_extraction.py from 4K tokens on, its setting below 4K, and a smaller one of ours
CWE_SETTINGS = ((10, 30, 3, (40, 10, 3)), (10, 6, 1, (20, 3, 1)), (5, 4, 1, (10, 2, 1)))


def _cwe_example(rng, template: str, n_words: int, rep_common: int, rep_other: int, n_common: int) -> str:
    """common_words_extraction.py get_example + generate_input_output's one-shot example: a list of
    ``n_words`` words (the first ``n_common`` repeated ``rep_common`` times, the others ``rep_other``),
    shuffled and numbered, in the template, followed by its answer as a numbered list."""
    vocab = words()
    drawn = [vocab[i] for i in rng.choice(len(vocab), n_words, replace=False)]
    common, uncommon = drawn[:n_common], drawn[n_common:]
    listed = common * rep_common + uncommon * rep_other
    listed = [listed[i] for i in rng.permutation(len(listed))]
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    return template.format(context=context) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))


def _cwe_template(n_common: int) -> str:
    return RULER_TEMPLATES["cwe"].replace("10", str(n_common))


def cwe_setting(tok, length: int) -> tuple:
    """The richest of ``CWE_SETTINGS`` whose common words' entries take at most half of the tokens the
    one-shot example and the templates leave (entries costed at their mean over the word list):
    RULER's (10 x 30, others x 3) from 4K tokens on, its (10 x 6, x 1) below, (5 x 4, x 1) for the
    shortest lengths (or a byte-level tokenizer's long entries). A function of (tokenizer, length):
    every item agrees."""
    key = (tok.fingerprint, length)
    if key not in _CWE_SETTING:
        entry = (np.mean([len(x) for x in _pieces(tok, "words", 0)])
                 + np.mean([len(x) for x in _pieces(tok, "numbers", 1000)[:1000]]))
        fits = []
        for s in CWE_SETTINGS[0 if length >= 4096 else 1:]:
            n_c, rep_c, _, (ex_n, ex_rc, ex_ro) = s
            template = len(tok.encode(_cwe_template(n_c)))
            example = template + (ex_n * 1.0 + n_c * ex_rc + (ex_n - n_c) * ex_ro) * entry
            room = length - answer_budget(tok, length) - template - example
            if n_c * rep_c * entry <= room / 2:
                fits.append(s)
        _CWE_SETTING[key] = fits[0] if fits else CWE_SETTINGS[-1]
    return _CWE_SETTING[key]


_CWE_SETTING: dict[tuple, tuple] = {}


def answer_budget(tok, length: int) -> int:
    """Tokens reserved after every prompt at ``length`` (``Item.gen_tokens``): RULER's largest
    ``tokens_to_generate`` (128), or the bound of the longest answer any task may need (cwe's ten
    numbered words) if larger; the same for every task, so that one compiled generation and one
    compiled forward pass serve all tasks at a length."""
    return max(GEN_TOKENS, _gen_budget(_numbered(["x" * CWE_MAX_WORD] * 10)))


def _cwe(task, length, seed, index, tok, haystack=None, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    n_common, rep_common, rep_other, (ex_n, ex_rc, ex_ro) = cwe_setting(tok, length)
    template = _cwe_template(n_common)
    example = _cwe_example(rng, template, ex_n, ex_rc, ex_ro, n_common)
    before, after = split_template(template)
    prefix_ids, question_ids = encode(tok, example + "\n" + before), encode(tok, after)
    gen_tokens = answer_budget(tok, length)
    budget = length - len(prefix_ids) - len(question_ids) - gen_tokens
    vocab = words()
    word_ids = _pieces(tok, "words", 0)
    order = rng.permutation(len(vocab))
    common, pool = order[:n_common], order[n_common:]
    numbers = list(_pieces(tok, "numbers", max(budget, 1)))
    numbers[0] = encode(tok, "1.")  # the list starts its line: "1. word 2. word ..."
    num_cost = np.concatenate([[0], np.cumsum([len(x) for x in numbers])])

    def cost(entries: int, word_tokens: int) -> int:
        return int(num_cost[min(entries, len(numbers))]) + word_tokens

    word_tokens = rep_common * sum(len(word_ids[w]) for w in common)
    entries, n_other = n_common * rep_common, 0
    while n_other < len(pool):  # as many other words as fit
        more = rep_other * len(word_ids[pool[n_other]])
        if cost(entries + rep_other, word_tokens + more) > budget:
            break
        word_tokens, entries, n_other = word_tokens + more, entries + rep_other, n_other + 1
    if n_other < n_common or cost(entries, word_tokens) > budget:
        raise TooShort(f"{task} at {length} tokens leaves room for {n_other} other words, fewer than the "
                       f"{n_common} the distractors need (template, example and answer take {length - budget} "
                       "tokens)")
    fill = n_other
    while cost(entries, word_tokens) < budget:  # words listed once to reach the budget (cut at the end)
        if fill >= len(pool) or entries >= len(numbers):
            raise TooShort(f"{task}: {len(vocab):,} words are too few to fill {length} tokens")
        word_tokens, entries, fill = word_tokens + len(word_ids[pool[fill]]), entries + 1, fill + 1
    others = pool[:n_other]
    listed = np.concatenate([np.repeat(common, rep_common), np.repeat(others, rep_other), pool[n_other:fill]])
    listed = listed[rng.permutation(len(listed))]  # one shuffled list, as RULER's
    pieces = []
    for i, w in enumerate(listed):
        pieces += [numbers[i], word_ids[w]]
    body = np.concatenate(pieces)[:budget]
    first = {}
    for w in listed:
        first.setdefault(int(w), len(first))
    in_order = lambda ws: sorted((int(w) for w in ws), key=first.__getitem__)  # noqa: E731
    gold = [vocab[w] for w in in_order(common)]
    distractors = [_numbered([vocab[w] for w in in_order(rng.choice(others, n_common, replace=False))])
                   for _ in range(N_DISTRACTORS)]
    return Item(task, length, seed, index, None, np.concatenate([prefix_ids, body, question_ids]).astype(np.int32),
                gen_tokens, answers=tuple(gold), gold=_numbered(gold), distractors=tuple(distractors))


@lru_cache(maxsize=8)
def _zeta(alpha: float) -> float:
    return float(zeta(alpha))


def zipf_counts(n_words: int, vocab_size: int, alpha: float = FWE_ALPHA) -> np.ndarray:
    """freq_words_extraction.py gen_text: occurrences of each of ``vocab_size`` ranked words among
    ``n_words``: ``int(n k^-alpha / zeta(alpha))`` (the Riemann zeta normaliser)."""
    k = np.arange(1, vocab_size + 1, dtype=np.float64)
    return (n_words * (k ** -alpha) / _zeta(alpha)).astype(np.int64)


def _fwe(task, length, seed, index, tok, haystack=None, depths=None) -> Item:
    rng = item_rng(task, length, seed, index)
    before, after = split_template(RULER_TEMPLATES["fwe"])
    prefix_ids, question_ids = encode(tok, before), encode(tok, after)
    gen_tokens = answer_budget(tok, length)
    budget = length - len(prefix_ids) - len(question_ids) - gen_tokens
    # freq_words_extraction.py: vocab_size = (max_seq_length - tokens_to_generate) // 50
    vocab_size = max((length - TOKENS_TO_GENERATE["fwe"]) // 50, FWE_ANSWERS + 1 + N_DISTRACTORS + 1)
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
    pieces[1] = encode(tok, coded[listed[0]])  # the text starts after the template's own space
    gap = budget - sum(len(p) for p in pieces[1:])
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
    [0, 1]) overrides where the needles go (before unit ``int(n_units * depth)``). Raises
    :class:`TooShort` when ``length`` leaves no room for the task."""
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


__all__ = ["DEPTHS", "HAYSTACKS", "RULER_HAYSTACK", "RULER_TEMPLATES", "TASKS", "TOKENS_TO_GENERATE", "Haystack",
           "Item", "TooShort", "encode", "family", "haystack_for", "load_items", "make_item", "task_haystack",
           "vt_example"]

#!/usr/bin/env bash
# The one-GPU study (docs/RESULTS.md) in parts: each run of this script trains and evaluates the next part of
# configs/sweeps/study.claims.toml's `parts` (whole arms), then judges every claim on the rows of all the
# parts landed so far. From the repo root:
#
#   bash experiments/study.sh            # the next part; its rows, with the landed ones, end in $STUDY_ROOT
#   STUDY_PART=3 bash experiments/study.sh                 # a given part
#
# The parts landed so far live in docs/results/study (the rows of every run, no checkpoints); they are
# copied into the sweep root first, so the sweep skips their runs and the claims judge them with the new
# part's. Landing a part: unpack its archive (study_results.tar.gz) into docs/results/study and commit it;
# then `hybrid-lm claims docs/results/study --no-eval` rejudges everything without a GPU.
#
# Settings (environment):
#   STUDY_ROOT=runs/study                  the sweep root
#   STUDY_LANDED=docs/results/study        the landed parts' rows
#   STUDY_PART=N                           this part instead of the first not yet complete
#   STUDY_SECONDS=1500                     stop starting work after this long (a part of the study takes
#                                          10 to 22 minutes on one H100; a run keeps its last 100 s for the
#                                          evaluations and the archive)
#   STUDY_STORE=DIR STUDY_TOKENIZER=TOK.json STUDY_VOCAB=V
#                                          your own prepared store instead of the Python corpus (all three)
#   OUT=DIR                                also write the results there (one archive: study_results.tar.gz)
#
# Without a .venv, wheels in .whl/ (beside or inside the repo) are installed into /tmp/site first, as
# gpu.sh does.
set -u
cd "$(dirname "$0")/.."
END=${STUDY_SECONDS:-1500}
ROOT=${STUDY_ROOT:-runs/study}
LANDED=${STUDY_LANDED:-docs/results/study}
SPEC=configs/sweeps/study.toml
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ "$PY" = python3 ]; then
  source experiments/wheels.sh
  use_wheels || exit 1
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
HLM="$PY -m hybrid_lm.cli"
left() { echo $(( END - SECONDS )); }
minutes() { $PY -c "print(max(0.5, ($1) / 60))"; }
quiet() { grep -v -e "^W0000" -e "^I0000"; }
date -u +"start %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null

DATA=data_cache/study
EXTRA=()
if [ -n "${STUDY_STORE:-}" ]; then
  if [ -z "${STUDY_TOKENIZER:-}" ] || [ -z "${STUDY_VOCAB:-}" ]; then
    echo "STUDY_STORE needs STUDY_TOKENIZER (its tokenizer.json) and STUDY_VOCAB (its ids; data prepare prints it)"; exit 2
  fi
  EXTRA=(--gin_param "DataConfig.path = '$STUDY_STORE'" --gin_param "DataConfig.tokenizer = '$STUDY_TOKENIZER'"
         --gin_param "ModelConfig.vocab_size = $STUDY_VOCAB")
else
  # the corpus: the .py files of this Python and of its torch, transformers and sympy packages
  $HLM data python-corpus --out $DATA/corpus --no-progress || exit 1
  if [ ! -f $DATA/tokenizer/tokenizer.json ]; then
    echo "== tokenizer (32,768 ids) on $DATA/corpus/python.jsonl"
    $HLM data train-tokenizer --source text --path $DATA/corpus/python.jsonl --vocab 32768 --out $DATA/tokenizer \
      --no-progress || exit 1
  fi
  $HLM data prepare --source text --path $DATA/corpus/python.jsonl --tokenizer $DATA/tokenizer/tokenizer.json \
    --out $DATA/store --no-progress || exit 1
fi

# the landed parts' rows (never over a run that is here already: a part in progress keeps its checkpoints)
mkdir -p "$ROOT"
if [ -d "$LANDED" ]; then
  for d in "$LANDED"/*/; do
    n=$(basename "$d")
    [ -f "$d/config.json" ] && [ ! -e "$ROOT/$n" ] && cp -r "$d" "$ROOT/$n"
  done
  [ -f "$LANDED/sweep.json" ] && [ ! -f "$ROOT/sweep.json" ] && cp "$LANDED/sweep.json" "$ROOT/sweep.json"
fi
PART=${STUDY_PART:-$($HLM claims "$ROOT" --next-part 2>/dev/null | tail -1)}
if [ "$PART" = 0 ]; then
  echo "every part is landed: the study is complete ($LANDED/claims.md)"; exit 0
fi
MEMBERS=$($PY -c "import sys, tomllib; p = tomllib.load(open('configs/sweeps/study.claims.toml', 'rb'))['parts']
print(' '.join(p[int(sys.argv[1]) - 1]))" "$PART") || { echo "no part $PART in configs/sweeps/study.claims.toml"; exit 2; }
echo "== part $PART: $MEMBERS ($(left) s left)"
JOBS=$($HLM claims "$ROOT" --claims-file configs/sweeps/study.claims.toml --part-jobs "$PART" | tail -1) || exit 1

# training: stops by itself early enough to leave room for the evaluations; a later run continues it
$HLM sweep "$SPEC" --launch local --root "$ROOT" --only "$JOBS" --max-minutes "$(minutes "$(left) - 480")" \
  "${EXTRA[@]}" 2>&1 | quiet
echo "== claims: part $PART's evaluations, every landed part judged ($(left) s left)"
$HLM claims "$ROOT" --part "$PART" --max-minutes "$(minutes "$(left) - 100")" 2>&1 | quiet | tee /tmp/claims.log
if [ -n "${OUT:-}" ]; then  # one archive of every run's results files (no checkpoints), the claims and plots
  (cd "$ROOT" && tar -czf "$OUT/study_results.tar.gz" --exclude='*/checkpoints' --exclude='*/checkpoints_corrupt*' \
     --exclude='*/eval' --exclude='*/tb' --exclude='*/loss_curve.png' sweep.json claims.json claims.md plots next_line_* */ 2>/dev/null)
  cp "$DATA/corpus/corpus.json" "$OUT/corpus.json" 2>/dev/null
fi
NEXT=$($HLM claims "$ROOT" --next-part 2>/dev/null | tail -1)
if [ "$NEXT" = "$PART" ]; then
  echo "part $PART not complete: run this script again (on the same machine it continues)"
else
  echo "part $PART complete: land it (unpack study_results.tar.gz into $LANDED and commit)"
fi
date -u +"end %Y-%m-%dT%H:%M:%SZ ($SECONDS s)"

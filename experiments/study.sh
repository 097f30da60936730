#!/usr/bin/env bash
# The one-GPU study (docs/RESULTS.md), in calls of at most 10 minutes: run it again until it prints
# "study complete". Every step is idempotent, so each call continues where the last stopped and a call
# on a finished study does nothing but rewrite the summaries. From the repo root:
#
#   bash experiments/study.sh                 # corpus -> tokenizer -> store -> sweep -> claims
#
# Settings (environment):
#   STUDY_ROOT=runs/study                     the sweep root
#   STUDY_SPEC=configs/sweeps/study.toml      the sweep spec (e.g. a copy with budgets = [4] to save time)
#   STUDY_CLAIMS_ARGS="--no-table"            extra options of `hybrid-lm claims` (here: the claims' evaluations only)
#   STUDY_STORE=DIR STUDY_TOKENIZER=TOK.json STUDY_VOCAB=V
#                                             your own prepared store instead of the Python corpus (all three)
#   STUDY_SECONDS=570                         this call's budget (the device machine stops a command at 600)
#   HYBRID_LM_DETERMINISTIC=1                 deterministic GPU ops (docs/TRAINING.md); use a fresh STUDY_ROOT
#   OUT=DIR                                   also copy the results there (one archive: study_results.tar.gz)
#
# Without a .venv, wheels carried in .whl/ (beside or inside the repo) are installed into /tmp/site first, as
# gpu.sh does.
set -u
cd "$(dirname "$0")/.."
END=${STUDY_SECONDS:-570}
ROOT=${STUDY_ROOT:-runs/study}
SPEC=${STUDY_SPEC:-configs/sweeps/study.toml}
# the project's venv where there is one (make install); else the machine's python3 (the GPU image) with the
# wheels carried in .whl/
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ "$PY" = python3 ]; then
  source experiments/wheels.sh
  use_carried_wheels || exit 1
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# a set fraction wins (a smaller one leaves room for another process on the GPU)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
HLM="$PY -m hybrid_lm.cli"
left() { echo $(( END - SECONDS )); }
minutes() { $PY -c "print(max(0.5, ($1) / 60))"; }   # --max-minutes from seconds
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
  # the pilot's corpus: the .py files of this Python and of its torch, transformers and sympy packages
  $HLM data python-corpus --out $DATA/corpus --no-progress || exit 1
  if [ ! -f $DATA/tokenizer/tokenizer.json ]; then
    echo "== tokenizer (32,768 ids) on $DATA/corpus/python.jsonl"
    $HLM data train-tokenizer --source text --path $DATA/corpus/python.jsonl --vocab 32768 --out $DATA/tokenizer \
      --no-progress || exit 1
  fi
  $HLM data prepare --source text --path $DATA/corpus/python.jsonl --tokenizer $DATA/tokenizer/tokenizer.json \
    --out $DATA/store --no-progress || exit 1
fi

# training: a part stops by itself (saving the running job) early enough to leave room for its last compile,
# step and save; the next call continues
if [ "$(left)" -gt 120 ]; then
  echo "== sweep ($(left) s left)"
  $HLM sweep "$SPEC" --launch local --root "$ROOT" --max-minutes "$(minutes "$(left) - 100")" \
    "${EXTRA[@]}" 2>&1 | grep -v -e "^W0000" -e "^I0000"
fi
# training is over when every job finished or failed (sweep_error.txt: the claims then report its arm missing)
DONE=$($PY -c "import json, pathlib, sys; r = pathlib.Path(sys.argv[1]); f = r / 'sweep.json'
m = json.loads(f.read_text()) if f.exists() else {'jobs': [{'name': ''}]}
bad = [j['name'] for j in m['jobs'] if j['name'] and (r / j['name'] / 'sweep_error.txt').exists()]
[print('failed run (traceback in its sweep_error.txt):', n, file=sys.stderr) for n in bad]
print(all((r / j['name'] / 'sweep_done.json').exists() or j['name'] in bad for j in m['jobs']))" "$ROOT")
COMPLETE=0
if [ "$DONE" = "True" ] && [ "$(left)" -gt 130 ]; then
  echo "== claims ($(left) s left)"
  $HLM claims "$ROOT" ${STUDY_CLAIMS_ARGS:-} --max-minutes "$(minutes "$(left) - 100")" 2>&1 | grep -v -e "^W0000" -e "^I0000" | tee /tmp/claims.log
  grep -qx "claims complete" /tmp/claims.log && COMPLETE=1
  # each arm's speed for docs/BENCHMARKS.md (experiments/results/<device>/study.json)
  [ $COMPLETE = 1 ] && $PY experiments/report.py --study "$ROOT" --readme none >/dev/null
  $HLM collect "$ROOT" >/dev/null && $HLM eval-report "$ROOT" --out "$ROOT/plots" >/dev/null 2>&1
elif [ "$DONE" != "True" ]; then
  echo "training not finished: run this script again"
else
  echo "training finished, too little time left for the evaluations: run this script again"
fi
if [ -n "${OUT:-}" ] && [ -d "$ROOT" ]; then  # one archive: the device machine returns few files
  REPO=$PWD
  (cd "$ROOT" && tar -czf "$OUT/study_results.tar.gz" --ignore-failed-read sweep.json claims.json claims.md \
     table.csv plots */metrics.jsonl */eval.jsonl */config.json */provenance.json */sweep_done.json */sweep_run.json \
     "$REPO/$DATA/corpus/corpus.json" "$REPO"/experiments/results/*/study.json 2>/dev/null)
fi
[ $COMPLETE = 1 ] && echo "study complete: $ROOT/claims.md (docs/RESULTS.md includes it)"
date -u +"end %Y-%m-%dT%H:%M:%SZ ($SECONDS s)"

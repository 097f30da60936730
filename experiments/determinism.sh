#!/usr/bin/env bash
# Is a GPU training run reproducible, and what does HYBRID_LM_DETERMINISTIC=1 cost? From the repo root:
#
#   bash experiments/determinism.sh [MODEL...]        # MODEL: full sa_swa128 ssa (default: all three)
#
# Trains three of the study's S1 models (configs/sweeps/study.toml: `full`, the gated SA+SWA-128 hybrid,
# SSA; T = 4096, 32 x 4096 tokens per step, the embedded corpus at byte level, 60 steps) four times each:
# twice with HYBRID_LM_DETERMINISTIC=1 (docs/TRAINING.md), then twice with XLA's default GPU ops. Prints, per
# model and mode, whether the two runs' logged losses and gradient norms are bitwise equal, the first step
# where they differ, the median tokens/s over steps 20-60 of each run and the train step's compile time;
# the deterministic mode's throughput relative to the default's is the setting's cost (it includes the
# attention backend the setting picks: jla's kernel or ours instead of cuDNN, hybrid_lm/backends.py).
# Each run's whole output is kept in $DETERMINISM_ROOT/<model>-<mode><i>.log (default /tmp/determinism).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ "$PY" = python3 ]; then source experiments/wheels.sh; use_wheels || exit 1
else export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONUNBUFFERED=1 HYBRID_LM_COMPILATION_CACHE=off
ROOT=${DETERMINISM_ROOT:-/tmp/determinism}
rm -rf "$ROOT" && mkdir -p "$ROOT"
PARAMS=(--gin_param "ModelConfig.vocab_size = 256"
        --gin_param "DataConfig.source = 'embedded'" --gin_param "DataConfig.tokenizer = 'byte'"
        --gin_param "DataConfig.seq_len = 4096" --gin_param "TrainConfig.global_batch = 32"
        --gin_param "TrainConfig.steps = 60" --gin_param "TrainConfig.log_every = 5"
        --gin_param "TrainConfig.eval_every = 1000" --gin_param "CheckpointConfig.every_steps = 1000")
# the study's arms of the same names: cuDNN attention / the SA permutation's gathers and SWA / our MoBA kernels
declare -A MODEL=(
  [full]="--gin_param ModelConfig.layer_pattern='F'"
  [sa_swa128]="configs/arch/sa_swa.gin --gin_param efficient/MixerConfig.window=128"
  [ssa]="configs/arch/ssa.gin")
ALL=(full sa_swa128 ssa)
if [ $# -gt 0 ]; then MODELS=("$@"); else MODELS=("${ALL[@]}"); fi
for model in "${MODELS[@]}"; do
  [ -n "${MODEL[$model]:-}" ] || { echo "error: unknown model '$model' (choose from: ${ALL[*]})" >&2; exit 2; }
done
for model in "${MODELS[@]}"; do
  for mode in deterministic default; do  # the setting under test first: a run cut short still answers it
    for i in 1 2; do
      run=$model-$mode$i; echo "== $run"
      det=0; [ $mode = deterministic ] && det=1
      # the whole output kept: a run that dies in XLA's C++ code prints no `error:` line of ours
      # shellcheck disable=SC2086  # MODEL's words split on purpose
      HYBRID_LM_DETERMINISTIC=$det $PY -m hybrid_lm.cli train configs/base.gin configs/scale/s1.gin ${MODEL[$model]} "${PARAMS[@]}" \
        --workdir "$ROOT/$run" > "$ROOT/$run.log" 2>&1
      rc=$?
      grep -E "^backend  layer|compiled in" "$ROOT/$run.log"
      if [ $rc != 0 ]; then
        echo "== $run failed (exit status $rc); the end of $ROOT/$run.log:"
        grep -v -e "^W0000" -e "^I0000" "$ROOT/$run.log" | tail -n 40
        exit 1
      fi
    done
  done
done
$PY experiments/determinism.py "$ROOT" "${MODELS[@]}"  # the summary: bitwise equal, tokens/s, the ratio

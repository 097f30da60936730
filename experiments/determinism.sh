#!/usr/bin/env bash
# Is a GPU training run reproducible, and what does HYBRID_LM_DETERMINISTIC=1 cost? From the repo root:
#
#   bash experiments/determinism.sh
#
# Trains one S1 full-attention run (T = 4096, 32 x 4096 tokens per step, the embedded corpus at byte level,
# 60 steps) four times: twice with XLA's default GPU ops, twice with HYBRID_LM_DETERMINISTIC=1
# (docs/TRAINING.md). Prints, per mode, whether the two runs' logged losses and gradient norms are
# bitwise equal, the first step where they differ, and the median tokens/s over steps 20-60 of each run;
# the deterministic mode's throughput relative to the default's is the setting's cost (it includes the
# attention backend the setting picks: jla's kernel or ours instead of cuDNN, hybrid_lm/backends.py).
# Each run's whole output is kept in $DETERMINISM_ROOT/<mode><i>.log (default /tmp/determinism).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ "$PY" = python3 ]; then source experiments/wheels.sh; use_carried_wheels || exit 1
else export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONUNBUFFERED=1 HYBRID_LM_COMPILATION_CACHE=off
ROOT=${DETERMINISM_ROOT:-/tmp/determinism}
rm -rf "$ROOT" && mkdir -p "$ROOT"
ARGS=(configs/base.gin configs/scale/s1.gin
      --gin_param "ModelConfig.layer_pattern = 'F'" --gin_param "ModelConfig.vocab_size = 256"
      --gin_param "DataConfig.source = 'embedded'" --gin_param "DataConfig.tokenizer = 'byte'"
      --gin_param "DataConfig.seq_len = 4096" --gin_param "TrainConfig.global_batch = 32"
      --gin_param "TrainConfig.steps = 60" --gin_param "TrainConfig.log_every = 5"
      --gin_param "TrainConfig.eval_every = 1000" --gin_param "CheckpointConfig.every_steps = 1000")
for mode in default deterministic; do
  for i in 1 2; do
    echo "== $mode $i"
    det=0; [ $mode = deterministic ] && det=1
    # the whole output kept: a run that dies in XLA's C++ code prints no `error:` line of ours
    HYBRID_LM_DETERMINISTIC=$det $PY -m hybrid_lm.cli train "${ARGS[@]}" --workdir "$ROOT/$mode$i" \
      > "$ROOT/$mode$i.log" 2>&1
    rc=$?
    grep -E "^backend .*attention|compiled in" "$ROOT/$mode$i.log"
    if [ $rc != 0 ]; then
      echo "== $mode $i failed (exit status $rc); the end of $ROOT/$mode$i.log:"
      grep -v -e "^W0000" -e "^I0000" "$ROOT/$mode$i.log" | tail -n 40
      exit 1
    fi
  done
done
$PY - "$ROOT" <<'PY'
import json, statistics, sys
from pathlib import Path
root = Path(sys.argv[1])
def rows(run):
    return [r for r in map(json.loads, (root / run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
speed = {}
for mode in ("default", "deterministic"):
    a, b = rows(f"{mode}1"), rows(f"{mode}2")
    diff = [x["step"] for x, y in zip(a, b) if (x["loss"], x["grad_norm"]) != (y["loss"], y["grad_norm"])]
    speed[mode] = [statistics.median(r["tokens_per_sec"] for r in rs if r["step"] >= 20) for rs in (a, b)]
    print(f"{mode:13s}  bitwise equal: {not diff}  first differing logged step: {diff[0] if diff else '-'}  "
          f"loss at step {a[-1]['step']}: {a[-1]['loss']!r} / {b[-1]['loss']!r}  "
          f"median tokens/s: {speed[mode][0]:,.0f} / {speed[mode][1]:,.0f}")
ratio = statistics.mean(speed["deterministic"]) / statistics.mean(speed["default"])
print(f"deterministic / default tokens/s: {ratio:.3f}")
PY

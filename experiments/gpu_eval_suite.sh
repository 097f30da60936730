#!/usr/bin/env bash
# Issue 19 on one H200: train a short S1 run at 16K (embedded corpus), then time every eval task of
# `hybrid-lm eval` on its latest checkpoint, one process per task; then the checkpoint before it, so
# the plots in RUN/eval/ show two points. Also issue 18's selection check + S5 sparse train steps
# (mode "all"). JSON rows, plots and logs go to $OUT.
#
#   bash experiments/gpu_eval_suite.sh all      # selection check, S1 suite, S5 sparse steps (one call)
#   bash experiments/gpu_eval_suite.sh suite    # only the S1 suite
source "$(dirname "$0")/gpu_env.sh"
export HYBRID_LM_DATA_DIR=/tmp/hl_data
date -u +"start %Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v -e "^W1201" -e "^I0000" -e "^W0000" -e "slow_operation" -e "Constant folding" -e "^$"; }
RUN=/tmp/s1_suite
suite() {
  timeout 150 python3 -m hybrid_lm.cli train configs/scale/s1.gin --workdir $RUN \
    --gin_param TrainConfig.steps=60 --gin_param TrainConfig.global_batch=8 --gin_param OptimConfig.warmup_steps=10 \
    --gin_param CheckpointConfig.every_steps=30 --gin_param TrainConfig.eval_every=30 --gin_param DataConfig.eval_windows=2 \
    --gin_param ModelConfig.remat="'dots_attn'" --gin_param TrainConfig.progress=False 2>&1 | quiet | tail -8
  # The acceptance measure: all six tasks on the latest checkpoint in ONE process (restore, compile,
  # run), timed end to end. Then the earlier checkpoint, so the over-training plots have two points.
  t0=$SECONDS
  timeout 420 python3 -m hybrid_lm.cli eval $RUN --tasks loss,longppl,ruler,probe,heads,influence --steps 60 \
    --eval-windows 2 --docs 2 2>&1 | quiet | grep -v "it/s\]" | tail -60
  echo "== step 60, six tasks, one process: $(( SECONDS - t0 )) s wall (restore and compiles included)"
  left=$(( ${SUITE_END:-560} - SECONDS ))
  echo "== $left s left for step 30"
  [ $left -gt 40 ] && timeout $left python3 -m hybrid_lm.cli eval $RUN --tasks loss,longppl,probe,heads,influence,ruler \
    --steps 30 --eval-windows 2 --docs 2 2>&1 | quiet | grep -v "it/s\]" | tail -40
  cp -r $RUN/eval "$OUT/s1_eval_plots" 2>/dev/null; cp $RUN/eval.jsonl $RUN/metrics.jsonl "$OUT/" 2>/dev/null
}
case "${1:-all}" in
  all)
    timeout 100 python3 experiments/bench_selection.py --check --T 16384 --out "$OUT/bench_selection.json" 2>&1 | quiet | tail -40
    SUITE_END=400 suite
    left=$(( 575 - SECONDS ))
    echo "== $left s left for the S5 sparse train steps"
    [ $left -gt 80 ] && timeout $left python3 experiments/bench_train.py --scale s5 \
      --arch full@dots_attn,moba16@dots_attn,ssa@dots_attn --batch 2 --steps 3 --compile-workers 3 \
      --deadline $(( left - 10 )) --out "$OUT/bench_train_s5_sparse.json" 2>&1 | quiet | grep -v gin_param
    ;;
  suite) suite ;;
esac
date -u +"end %Y-%m-%dT%H:%M:%SZ"

#!/usr/bin/env bash
# The benchmarks and the GPU tests on one GPU, each mode within a time budget (GPU_SH_SECONDS, default 575 s).
# From the repo root:
#
#   bash experiments/gpu.sh readme              # the README's table: S5 train step x 9 archs + the anchor GPT,
#                                               # decoding at 128K; then docs/BENCHMARKS.md and the README block
#   bash experiments/gpu.sh bench [NAMES...]    # the other benchmarks (default: all of them, as many as fit);
#                                               # eval: a 30-step S1 run at 16K, then the whole suite on it
#                                               # (its rows and plots: $OUT/eval_s1.tar.gz)
#   bash experiments/gpu.sh test [PATHS...]     # pytest tests/gpu (or PATHS): the kernels' checks against their references
#
# NAMES: attention sparse mixers kernels decode eval data. Results: experiments/results/<device>/<bench>.json,
# also copied to $OUT/results/<device>/ (the log to $OUT/<mode>.log) when OUT=DIR is set. Wheels in .whl/
# (beside or inside the repo; experiments/gpu_wheels.txt lists them and the command that downloads them)
# are installed into /tmp/site first where their packages are missing; without them the installed jax is used.
set -u
cd "$(dirname "$0")/.."
MODE=${1:-readme}
shift || true
END=${GPU_SH_SECONDS:-575}   # seconds the whole mode may take: each benchmark's timeout is cut to what is left
source experiments/wheels.sh
use_wheels || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 HYBRID_LM_COMPILATION_CACHE=off
unset JAX_COMPILATION_CACHE_DIR
PY=${PY:-python3}
DEVICE=$($PY -c "import sys; sys.path.insert(0, 'experiments'); import harness; print(harness.device_name())") || exit 1
LOG=${OUT:+$OUT/$MODE.log}
exec > >(tee ${LOG:-/dev/null}) 2>&1
date -u +"start %Y-%m-%dT%H:%M:%SZ, device $DEVICE"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null

quiet() { grep -v -e "^W0000" -e "^I0000" -e "^W1[0-9]" -e "^I1[0-9]" -e "slow_operation" -e "Constant folding" -e "sees every key"; }
left() { echo $(( END - SECONDS )); }
# run NAME SECONDS ARGS...: experiments/bench_NAME.py under a timeout of SECONDS (or what is left, if less)
run() {
  local name=$1 want=$2 t; shift 2
  t=$(left); [ "$want" -lt "$t" ] && t=$want
  if [ "$t" -lt 30 ]; then echo "== $name: not run, no time left: run \`bash experiments/gpu.sh bench $name\`"; return; fi
  echo "== $name ($t s at most)"
  timeout "$t" $PY "experiments/bench_$name.py" "$@" 2>&1 | quiet
  [ "${PIPESTATUS[0]}" -eq 124 ] && echo "== $name: stopped at its time limit; its JSON keeps the rows it finished"
}
collect() {
  if [ -n "${OUT:-}" ] && [ -d "experiments/results/$DEVICE" ]; then
    mkdir -p "$OUT/results/$DEVICE" && cp experiments/results/"$DEVICE"/*.json "$OUT/results/$DEVICE/" 2>/dev/null
  fi
}

case "$MODE" in
  readme)
    # compiles overlap (10 at once), the deadline keeps the timings inside the budget; decoding gets the rest
    run train 400 --scale s5 --arch full,swa,sa,sa_swa,lightning,mamba2,gdn,moba,ssa --batch rule --anchor-batch 4 \
      --steps 3 --compile-workers 10 --deadline 380
    run decode 170 --layer-contexts none --model-contexts 131072 --deadline $(( $(left) - 40 ))
    $PY experiments/report.py --print
    collect
    ;;
  bench)
    NAMES=${*:-attention sparse mixers kernels decode eval data}
    for name in $NAMES; do
      case "$name" in
        attention) run attention 240 ;;
        sparse) run sparse 150 ;;
        mixers) run mixers 120 ;;
        kernels) run kernels 90 ;;
        decode) run decode 240 --deadline 150 ;;
        eval)  # the run stays in /tmp/eval_s1
          rm -rf /tmp/eval_s1
          run eval 570 --keep /tmp/eval_s1
          # the run's eval rows and plots, as one archive beside the result JSONs
          [ -n "${OUT:-}" ] && tar -czf "$OUT/eval_s1.tar.gz" -C /tmp/eval_s1 eval.jsonl eval 2>/dev/null
          ;;
        data) run data 200 ;;
        *) echo "unknown benchmark $name: choose from attention sparse mixers kernels decode eval data"; exit 2 ;;
      esac
    done
    $PY experiments/report.py
    collect
    ;;
  test)
    # tests/conftest.py defaults the suite to the CPU and to XLA without its optimisations: not here.
    # PATHS (default tests/gpu): the whole suite compiles for longer than the default budget: raise
    # GPU_SH_SECONDS, or split it, e.g. `test tests/gpu/test_gpu_attention.py`, then the other files.
    JAX_PLATFORMS=cuda,cpu JAX_DISABLE_MOST_OPTIMIZATIONS=0 timeout "$(left)" \
      $PY -m pytest -q -p no:cacheprovider -m gpu -rs ${*:-tests/gpu} 2>&1 | quiet
    ;;
  *) echo "usage: bash experiments/gpu.sh readme | bench [NAMES...] | test"; exit 2 ;;
esac
date -u +"end %Y-%m-%dT%H:%M:%SZ ($SECONDS s)"

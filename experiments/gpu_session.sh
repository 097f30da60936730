#!/usr/bin/env bash
# The GPU measurements still owed (docs/ROADMAP.md), in one device call. Run from the repo root on
# the device machine with `.whl` carried:
#
#   bash experiments/gpu_session.sh kernels     # one GPU: MoBA 32K table, SSA block 16, windowed table
#   bash experiments/gpu_session.sh multi       # >= 2 GPUs: FSDP + restore (experiments/multi_gpu.py)
#
# Logs and JSON go to $OUT (or ./gpu_out). With two GPUs, `kernels` runs its jobs on both at once.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ln -sfn "$PWD/kernels" /tmp/site/hybrid_lm_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
NGPU=$(nvidia-smi -L | grep -c '^GPU ')
echo "GPUs: $NGPU"

run() {  # run <gpu> <seconds> <name> <command...>
  local gpu=$1 secs=$2 name=$3
  shift 3
  echo "== $name on GPU $gpu (limit ${secs}s)"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name exit $?"
  grep -E '^\||PASS|FAIL|==' "$OUT/$name.log" | grep -v '^  PASS' | tail -25
}

case "${1:-kernels}" in
  kernels)
    second=$(( NGPU > 1 ? 1 : 0 ))
    {
      run 0 300 moba python3 experiments/bench_attention.py --moba-only --check --out "$OUT/moba.json"
      run 0 200 ssa16 python3 experiments/bench_attention.py --moba-only --moba-T 16384 --moba-block 16 \
        --moba-topk 16 --moba-configs m64 --moba-xla --out "$OUT/ssa16.json"
    } &
    if [ "$second" = 1 ]; then
      run 1 500 windowed python3 experiments/bench_attention.py --out "$OUT/windowed.json" \
        --impls cudnn,pallas_swa,pallas_sa,pallas_sa_sym,jla &
      wait
    else
      wait
      run 0 500 windowed python3 experiments/bench_attention.py --out "$OUT/windowed.json" \
        --impls cudnn,pallas_swa,pallas_sa,pallas_sa_sym,jla
    fi
    ;;
  multi)
    [ "$NGPU" -ge 2 ] || { echo "needs >= 2 GPUs"; exit 1; }
    timeout 560 python3 experiments/multi_gpu.py --runs single,fsdp,restore --steps 50 --per-gpu-batch 2 \
      --out "$OUT/multi_gpu.json" 2>&1 | grep -v gin_param | tail -30
    ;;
  *) echo "usage: $0 kernels|multi"; exit 2 ;;
esac

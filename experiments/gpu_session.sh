#!/usr/bin/env bash
# The GPU measurements still owed (docs/ROADMAP.md), in one device call. Run from the repo root on
# the device machine with `.whl` carried:
#
#   bash experiments/gpu_session.sh kernels     # one GPU: windowed check + table, MoBA 32K, SSA 16, mixers
#   bash experiments/gpu_session.sh table       # one GPU: the attention table alone, MoBA block-selection step
#   bash experiments/gpu_session.sh trainer     # one GPU: train steps per backend, runs with pallas
#   bash experiments/gpu_session.sh multi       # >= 2 GPUs: FSDP + restore (experiments/multi_gpu.py)
#
# JSON goes to $OUT (or ./gpu_out); pipe through `tee $OUT/session.log` for the whole log.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
ln -sfn "$PWD/kernels" /tmp/site/hybrid_lm_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
NGPU=$(nvidia-smi -L | grep -c '^GPU ')
echo "GPUs: $NGPU"

case "${1:-kernels}" in
  kernels)
    # One process per part of the attention benchmark (check, each shape, MoBA) plus the SSA
    # block-16 timing and the mixer layers: compiles overlap, GPU executions take turns on $LOCK.
    LOCK=/tmp/gpu.lock
    export CUDA_VISIBLE_DEVICES=0
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 experiments/bench_attention.py \
      --moba-only --moba-T 16384 --moba-block 16 --moba-topk 16 --moba-configs m64 --moba-xla \
      --gpu-lock $LOCK --out "$OUT/ssa16.json" > /tmp/ssa16.log 2>&1 &
    ssa=$!
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 flock $LOCK bash -c "for w in 128 512 2048; do
        python3 experiments/bench_mixer.py --impl pallas --kinds swa,sa,sa_swa --window \$w \
          --out $OUT/mixer_w\$w.json; done" > /tmp/mixer.log 2>&1 &
    mixer=$!
    timeout 550 python3 experiments/bench_attention.py --parallel --gpu-lock $LOCK --check --moba \
      --moba-jla --impls cudnn,pallas_swa,pallas_sa,pallas_sa_sym,pallas_sa_gather,jla,jla_fused \
      --reps 5 --out "$OUT/attention.json"
    wait $ssa; echo "== ssa16 exit $?"; tail -25 /tmp/ssa16.log
    wait $mixer; echo "== mixer exit $?"; cat /tmp/mixer.log
    ;;
  table)
    # The full attention table alone (one run), then MoBA train steps with per-block selection in
    # whatever time is left of the call's 10 minutes.
    export CUDA_VISIBLE_DEVICES=0
    timeout 550 python3 experiments/bench_attention.py --parallel --check --moba --moba-jla \
      --impls cudnn,pallas_swa,pallas_sa,pallas_sa_sym,pallas_sa_gather,jla,jla_fused --reps 5 \
      --out "$OUT/attention.json"
    left=$(( 590 - SECONDS ))
    [ $left -gt 60 ] && timeout $left python3 experiments/bench_train.py --scale s4 --arch moba_block \
      --impl auto --steps 5 --out "$OUT/train_moba_block.json" 2>&1 | grep -v gin_param
    ;;
  trainer)
    # The trainer on the kernels: S4 train steps per backend (auto records what it resolved to),
    # then short real runs (hybrid-lm train) with attention_impl=pallas, and one clean table row.
    export CUDA_VISIBLE_DEVICES=0
    timeout 330 python3 experiments/bench_train.py --scale s4 --arch full,swa,sa,moba,moba16 --impl auto \
      --steps 5 --out "$OUT/train_auto.json" 2>&1 | grep -v gin_param
    timeout 90 python3 experiments/bench_train.py --scale s4 --arch swa --impl pallas --steps 5 \
      --out "$OUT/train_pallas.json" 2>&1 | grep -v gin_param
    for arch in sa moba; do
      timeout 60 python3 -m hybrid_lm.cli train configs/quickstart.gin configs/arch/$arch.gin \
        --workdir /tmp/run_$arch --gin_param "ModelConfig.attention_impl='pallas'" \
        --gin_param "ModelConfig.compute_dtype='bfloat16'" --gin_param "TrainConfig.steps=100" \
        --gin_param "TrainConfig.progress=False" 2>&1 | grep -v gin_param | tail -3
      python3 -c "import json,sys; rows=[json.loads(l) for l in open('/tmp/run_$arch/metrics.jsonl')]
t=[r for r in rows if r.get('kind')=='train']; e=[r for r in rows if r.get('kind')=='eval']
print('$arch', t[-1]['step'], 'loss %.3f' % t[-1]['loss'], t[-1]['attention_impl'], t[-1]['attention_backends'], 'eval', e[-1])"
    done
    timeout 100 python3 experiments/bench_attention.py --shapes 16384x2 --windows 128 \
      --impls cudnn,pallas_swa,pallas_sa,jla --out "$OUT/row_16k_w128.json" | grep "^|"
    ;;
  multi)
    [ "$NGPU" -ge 2 ] || { echo "needs >= 2 GPUs"; exit 1; }
    timeout 560 python3 experiments/multi_gpu.py --runs single,fsdp,restore --steps 50 --per-gpu-batch 2 \
      --out "$OUT/multi_gpu.json" 2>&1 | grep -v gin_param | tail -30
    ;;
  *) echo "usage: $0 kernels|multi"; exit 2 ;;
esac

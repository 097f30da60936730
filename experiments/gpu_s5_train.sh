#!/usr/bin/env bash
# Issue 17's session-5 train-step measurements on one H200, two device calls (docs/BENCHMARKS.md):
#
#   bash experiments/gpu_s5_train.sh table    # S2-S4 x 7 archs x micro-batch {4, 8} until a deadline, then S5 scan
#   bash experiments/gpu_s5_train.sh profile  # jax.profiler trace of S3 full at 8 x 16K
#   bash experiments/gpu_s5_train.sh s5       # S5: full unrolled vs scan_layers compiled alone (B 8), then 7 archs at B 4
#   bash experiments/gpu_s5_train.sh remat    # session 6: remat dots vs dots_attn, S1-S5, one scale pair per process
#   bash experiments/gpu_s5_train.sh sparse   # session 6: fused selection check + table, S5 full / moba16 / ssa steps
#   bash experiments/gpu_s5_train.sh all7a    # session 7, issue 17's table, part 1: the anchor GPT, S1-S3 x 7 archs
#   bash experiments/gpu_s5_train.sh gather   # issue 18: gather kernel check + kernel table, then S5 sparse train steps
#   bash experiments/gpu_s5_train.sh gather2  # issue 18, session 8: gather as auto, union/fused beside it, S5 moba16 profile
#   bash experiments/gpu_s5_train.sh sparse18 # issue 18: S5 full/moba16/ssa train steps + decode at 128K, one run
#   bash experiments/gpu_s5_train.sh split18  # issue 18, session 9: the split selection kernels (check, parts), S5 steps, profile
#   bash experiments/gpu_s5_train.sh split18b # session 9: the selection's parts timed; S5 full / ssa_split steps; ssa_split profile
#   bash experiments/gpu_s5_train.sh final18  # session 9, third call: the bf16 split check, then sparse18 (auto = split_bf16)
#   bash experiments/gpu_s5_train.sh tune18   # session 10: bf16 split check, decode kernels (check, table), launch sweeps
#   bash experiments/gpu_s5_train.sh tune18b  # session 10: decode parts + profiles, gate tiles, S5 SSA step vs full
#   bash experiments/gpu_s5_train.sh final18b # session 10: issue 18's one-run table (checks, S5 steps, decode at 128K)
#   bash experiments/gpu_s5_train.sh check18  # session 10: decode check (moba, ssa_sparse), gather kernel check
#   bash experiments/gpu_s5_train.sh rest17a  # issue 17's missing table cells, 4 calls (a-d), each scale with its full row
#   bash experiments/gpu_s5_train.sh s5alone17 # session 11: S5 x 6 archs compiled alone, then gdn/lightning scanned
#   bash experiments/gpu_s5_train.sh s5lin17  # session 11: S5 lightning / mamba2 / gdn, strictly serial
#   bash experiments/gpu_s5_train.sh ops17    # session 11: S5's linear-attention ops compiled alone (compile_ops.py)
#   bash experiments/gpu_s5_train.sh why17    # session 11: S5 Lightning compiled four ways at once (remat, scan, xla)
#   bash experiments/gpu_s5_train.sh init17   # session 12: init compile (parts vs whole), then S5 linear mixers alone
#   bash experiments/gpu_s5_train.sh table17  # session 12: the anchor + S1-S4 x 7 archs, 4 compiles at a time
#   bash experiments/gpu_s5_train.sh s5cp17   # session 12: the S5 row, then dots_attn saving custom_partitioning outputs
#   bash experiments/gpu_s5_train.sh cpl17    # session 12: S5 Lightning with / without custom_partitioning saved
#   bash experiments/gpu_s5_train.sh prof17   # session 13: profiles (trace + optimised HLO) of S1 full/SWA/SA, S3 full/SWA at 8 x 16K
#   bash experiments/gpu_s5_train.sh xent17   # session 13: the loss kernel (check, launches, loss), S1/S3 steps xla vs pallas, jla full attention
#   bash experiments/gpu_s5_train.sh prof17b  # session 13: profiles without command buffers (parts of the step), S5 gdn/sa_swa +scan alone
#   bash experiments/gpu_s5_train.sh xent17b  # session 13: S1-S4 x full/SWA/SA, loss kernel xla vs pallas, timed after all compiles
#   bash experiments/gpu_s5_train.sh norm17   # session 14: the RMSNorm kernels (check, launches), S1/S3/S5 full+SWA steps, norms xla vs pallas
#   bash experiments/gpu_s5_train.sh mb17     # session 14: the micro-batch sweep under dots_attn, S1-S4 x full/SWA/SA x {8, 16}
#   bash experiments/gpu_s5_train.sh lin17    # session 14: the anchor, then S1-S4 x SA+SWA / linear mixers at B 16, timed after all compiles
#   bash experiments/gpu_s5_train.sh grp17    # session 15: jla's kernel on Mamba-2's B/C groups (GPU test), S5 mamba2 steps repeated vs grouped
#   bash experiments/gpu_s5_train.sh ce17     # session 15: jla's fused LM-head loss (bench_loss check + times), S1/S3 full steps, loss_kernel pallas vs jla
#   bash experiments/gpu_s5_train.sh sc17     # session 15: ShortConv's custom VJP vs autodiff (S3/S5 mamba2, gdn), S5 GDN profile by part
#   bash experiments/gpu_s5_train.sh row17    # session 15: the anchor, S1-S5 x Mamba-2 / GDN under the new defaults
#   bash experiments/gpu_s5_train.sh conv17   # session 16: ShortConv's backward kernel (bench_conv check + table), S3/S5 mamba2/gdn conv_kernel xla vs pallas
#   bash experiments/gpu_s5_train.sh none17   # session 16: S1-S4 x full/SWA/SA at 16 x 16K, remat none vs dots_attn, timed after all compiles
#   bash experiments/gpu_s5_train.sh row17c   # next: anchor, S1-S4 Mamba-2/GDN rows (conv kernel auto), S5 Mamba-2/GDN none B4 x accumulate 1 vs 4
#   bash experiments/gpu_s5_train.sh conv17b  # session 17: the rolling-window conv backward (check, launches), S5 mamba2/gdn no remat at 4, xla vs pallas
#   bash experiments/gpu_s5_train.sh gn18     # session 18: GDN's gated output norm kernel (check, launches), S5 GDN none B4: sliced / padded xla / padded pallas
#   bash experiments/gpu_s5_train.sh mbnone18 # session 18: the micro-batch sweep {8, 16} under remat none, S1-S4 x Mamba-2/GDN/Lightning/SA+SWA
#   bash experiments/gpu_s5_train.sh mbnone18b # session 18: the rest of the @none keys: S5 SA/SA+SWA/Lightning {4, 8}, S2/S4 full/SWA/SA {8, 16}
#   bash experiments/gpu_s5_train.sh acc18    # session 18: S4 full/SWA/SA without remat at 16, one micro-batch vs 4 accumulated (S4's global batch 64)
#   bash experiments/gpu_s5_train.sh final19a # session 19: issue 17's table, part 1: the anchor, S1-S4 x 7 archs, each at the rule's micro-batch (remat none)
#   bash experiments/gpu_s5_train.sh final19b # session 19: part 2 (the next call, same lease): S5 x 7 archs (none, rule: 4), S5 full/SWA under dots_attn at 8, the anchor
#   bash experiments/gpu_s5_train.sh final22a # session 22: final19a's commands again (JSON named final22a), then final22b: the table from one lease
#   bash experiments/gpu_s5_train.sh alone19  # session 19: S5 x 7 archs (none, B 4) compiled strictly one at a time, each timed after its compile
#   bash experiments/gpu_s5_train.sh mbsparse # session 19: the MoBA / SSA presets' micro-batch keys under remat none, S1-S4 x {8, 16}
#   bash experiments/gpu_s5_train.sh ct20     # session 20: S5 gdn / mamba2 / sa_swa compiles traced (host phases), GDN alone with / without Triton GEMMs
#   bash experiments/gpu_s5_train.sh ct20b    # session 20: S5 GDN compiled alone and timed under XLA compile levers (scheduler, autotuner, autotune cache)
#   bash experiments/gpu_s5_train.sh ct20c    # session 20: S5 GDN / SA+SWA compiles traced, their optimised HLO saved (kernels counted offline)
#   bash experiments/gpu_s5_train.sh ct20d    # session 20: S5 GDN / Mamba-2 compile traces with each phase's wall time (union over threads)
#   bash experiments/gpu_s5_train.sh ct20e    # session 20: S5 GDN compile traced with XLA's per-fusion autotune cache cold, then warm
#   bash experiments/gpu_s5_train.sh scan20   # session 21: S5 gdn / mamba2 / sa_swa unrolled vs scan_layers under the presets' remat (none, B 4), alone
#   bash experiments/gpu_s5_train.sh acc21    # session 21: S3 full/SWA/SA as runs take it (3 x 16 accumulated); S5 GDN vs the same without q/k L2 norms (a bound)
#   bash experiments/gpu_s5_train.sh bound21  # session 21: S5 GDN vs the same with the q/k L2 norms as a constant scale (finite data)
#   bash experiments/gpu_s5_train.sh power21  # session 21: one bf16 GEMM's speed, SM clock and power by operand values (bench_data_power.py)
#   bash experiments/gpu_s5_train.sh prof21   # session 21: S5 GDN profiled by part with and without the q/k L2 norms (trace + HLO back)
#   bash experiments/gpu_s5_train.sh h100fit22 # session 22, on an H100: S3-S5 x 7 archs at the rule's micro-batch fitted to the device's memory
#   bash experiments/gpu_s5_train.sh mbnone17 # session 16: the micro-batch sweep {8, 16} under remat none, S1/S3 x full/SWA/SA
#   bash experiments/gpu_s5_train.sh s5none17 # session 16: S5 x full/SWA/Mamba-2/GDN at 4 x 16K, remat none vs dots_attn; then 8 x 16K dots_attn
#   bash experiments/gpu_s5_train.sh all7b    # part 2: S1's slow-compiling archs, S3-S5 full/SWA/SA
#
# Run from the repo root (or a `git archive` of it) on the device machine with `.whl` beside or
# inside it. JSON goes to $OUT; every step has a timeout so the call ends inside its 10 minutes.
source "$(dirname "$0")/gpu_env.sh"
export HYBRID_LM_COMPILATION_CACHE=off
unset JAX_COMPILATION_CACHE_DIR
date -u +"start %Y-%m-%dT%H:%M:%SZ"; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
ARCHS=full,swa,sa,sa_swa,lightning,mamba2,gdn
# PROF seconds arch: a jax.profiler trace of 2 S5 steps at B 2 under dots_attn, with its top-40 kernel table
PROF() { timeout "$1" python3 experiments/profile_train.py --scale s5 --arch "$2" --batch 2 --remat dots_attn \
  --steps 2 --top 40 --out-dir "$OUT/profile_s5_$2" 2>&1 | grep -v -e "^W0000" -e "^I0000" -e "^W1201" | tail -60; }
# CT seconds arch top name [profile_train args...]: the S5 step's compile (none, B 4) traced, its top host
# phases printed and kept as $OUT/compile_phases_<name>.json (the trace and any --hlo file under /tmp/ct_<name>)
CT() { local secs=$1 a=$2 top=$3 name=$4; shift 4
  timeout "$secs" python3 experiments/profile_train.py --compile-trace --scale s5 --arch "$a" --batch 4 --remat none \
    --top "$top" --out-dir "/tmp/ct_$name" "$@" 2>&1 | grep -v -e "^W0000" -e "^I0000" -e "^W1204" -e gin_param \
    | tail -$(( top + 4 ))
  cp "/tmp/ct_$name/compile_phases.json" "$OUT/compile_phases_$name.json"; }
# BOUNDPY seconds variant script [args...]: an experiments script with GDN's q/k L2 norms as runs take them
# (variant as_run), replaced by the identity (no_qk_l2norm: the loss went NaN in session 21, and NaN data runs
# every kernel 12-14% faster, so that variant's times are not valid), or by a constant scale (qk_scaled: x / sqrt(Dk),
# elementwise, the values finite): a bound on what the norms' reductions cost in the step
BOUNDPY() { local secs=$1 v=$2 script=$3; shift 3
  NOQK=$v timeout "$secs" python3 -c "
import os, runpy, sys
if os.environ['NOQK'] != 'as_run':
    import hybrid_lm.model.gated_deltanet as g
    g.l2norm = (lambda x: x) if os.environ['NOQK'] == 'no_qk_l2norm' else (lambda x: x * x.shape[-1] ** -0.5)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')" "$script" "$@"; }
# BOUND_GDN name variant...: S5 GDN (none, B 4) compiled alone and timed once per BOUNDPY variant, the first
# given half of the time left before script time 585 s; JSON to $OUT/bench_train_<name>_gdn_<variant>.json
BOUND_GDN() { local name=$1 v left; shift
  for v in "$@"; do
    left=$(( 585 - SECONDS )); [ "$v" = "$1" ] && left=$(( left / 2 ))
    echo "== s5 gdn ($v, $left s)"
    BOUNDPY $left $v experiments/bench_train.py --scale s5 --arch gdn --remat none --batch 4 --steps 4 \
      --compile-alone --out "$OUT/bench_train_${name}_gdn_$v.json" 2>&1 | grep -E "^s5 |rror|Traceback" | cut -c1-240
  done; }
# XLA's slow-constant-folding alarms are kept (one line each, cut short): until session 12 this filter
# dropped them, and they named the cause of the S5 Lightning compile (a folded per-layer decay)
B() { timeout "$1" python3 experiments/bench_train.py "${@:2}" 2>&1 | grep -v -e gin_param -e "^W1201" \
  -e "isn.t necessarily" -e "If you.d like" -e "^$" | cut -c1-240; }
# ACC until M prefix bench_train-args...: the same variants with --accumulate 1, then M (gradients of M
# micro-batches summed per step), each given half of the seconds left before script time `until`; JSON to $OUT/<prefix><count>.json
ACC() {
  local until=$1 m=$2 prefix=$3 a end left; shift 3
  for a in 1 "$m"; do
    end=$until; [ "$a" = 1 ] && end=$(( SECONDS + (until - SECONDS) / 2 ))
    left=$(( end - SECONDS ))
    echo "== --accumulate $a: $left s"
    B $left "$@" --accumulate "$a" --time-after-compiles --deadline $(( left - 8 )) --out "$OUT/$prefix$a.json"
  done
}

case "${1:-table}" in
  table)  # the one-call plan after the first call of session 5 (see docs/BENCHMARKS.md)
    B 300 --scale s2,s3,s4 --arch full,swa,sa,lightning,sa_swa,mamba2,gdn --order arch --sweep-microbatch 4,8 \
      --steps 5 --compile-workers 6 --deadline 270 --out "$OUT/bench_train_s2_s4.json" \
      --table-out "$OUT/microbatch_h200.json"
    left=$(( 525 - SECONDS ))
    echo "== $left s left for S5 full, unrolled and scanned, compiled alone"
    [ $left -gt 60 ] && B $left --scale s5 --arch full,full+scan --batch 8 --compile-alone --steps 4 \
      --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_scan.json"
    ;;
  s5)
    # compile alone: the all-full stack unrolled, then scanned, at 8 x 16K tokens (the memory target)
    B 130 --scale s5 --arch full,full+scan --batch 8 --compile-alone --steps 4 --deadline 120 \
      --out "$OUT/bench_train_s5_scan.json"
    left=$(( 575 - SECONDS ))
    echo "== $left s left for the S5 table"
    B $left --scale s5 --arch full,swa,sa,sa_swa,lightning,mamba2,gdn,gdn+scan --batch 4 --steps 4 \
      --compile-workers 9 --deadline $(( left - 25 )) --out "$OUT/bench_train_s5.json"
    ;;
  remat)  # session 6: does saving the attention kernels' outputs lift the MFU cap? (ROADMAP issue 17)
    A="full@dots,full@dots_attn,swa@dots_attn,sa@dots_attn,sa_swa@dots_attn"
    B 150 --scale s1,s2 --arch $A --batch 8 --steps 5 --compile-workers 5 --deadline 140 \
      --out "$OUT/bench_train_s1_s2_remat.json"
    B 190 --scale s3,s4 --arch $A --batch 8 --steps 5 --compile-workers 5 --deadline 180 \
      --out "$OUT/bench_train_s3_s4_remat.json"
    left=$(( 570 - SECONDS ))
    echo "== $left s left for S5"
    [ $left -gt 60 ] && B $left --scale s5 --arch full@dots,full@dots_attn,swa@dots_attn,lightning@dots_attn,gdn@dots_attn \
      --batch 8 --steps 4 --compile-workers 5 --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_remat.json"
    ;;
  sparse)  # issue 18: the fused gate + top-k selection, then the model-level train steps (T=16K, B=2)
    timeout 260 python3 experiments/bench_selection.py --check --out "$OUT/bench_selection.json" 2>&1 \
      | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | tail -60
    left=$(( 570 - SECONDS ))
    echo "== $left s left for the S5 train steps"
    [ $left -gt 90 ] && B $left --scale s5 --arch full@dots,full@dots_attn,moba16@dots_attn,ssa@dots_attn \
      --batch 2 --steps 4 --compile-workers 4 --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_sparse.json"
    ;;
  all7a)  # issue 17's table (remat dots_attn, 8 x 16K = 128K tokens per micro-batch), one scale per process
    timeout 110 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out "$OUT/anchor_gpt.json" \
      2>&1 | grep -v -e "^W1201" -e "^I0000" -e "^W0000"
    for s in s1:120 s2:130 s3:150; do
      B $(( ${s#*:} + 10 )) --scale ${s%:*} --arch $ARCHS --remat dots_attn --batch 8 --steps 5 --compile-workers 7 \
        --deadline ${s#*:} --out "$OUT/bench_train_${s%:*}_table.json"
    done
    ;;
  all7b)  # part 2 (next call): S1's four slow-compiling archs with 4 compiles at a time, then S3-S5 full/SWA/SA
    B 240 --scale s1 --arch sa_swa,lightning,mamba2,gdn --remat dots_attn --batch 8 --steps 5 --compile-workers 4 \
      --deadline 230 --out "$OUT/bench_train_s1b_table.json"
    B 110 --scale s3 --arch swa,sa --remat dots_attn --batch 8 --steps 5 --compile-workers 2 --deadline 100 \
      --out "$OUT/bench_train_s3b_table.json"
    left=$(( 565 - SECONDS ))
    echo "== $left s left for S4 and S5"
    [ $left -gt 60 ] && B $left --scale s4,s5 --arch full,swa,sa --remat dots_attn --batch 8 --steps 4 --compile-workers 6 \
      --deadline $(( left - 10 )) --out "$OUT/bench_train_s4_s5_table.json"
    ;;
  gather)  # issue 18: the per-token gather kernel (session 7), alone and in the S5 train step (T=16K, B=2)
    timeout 260 python3 experiments/bench_gather_sparse.py --check --T 16384,32768 --out "$OUT/bench_gather_sparse.json" 2>&1 \
      | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | tail -40
    left=$(( 570 - SECONDS ))
    echo "== $left s left for the S5 train steps"
    [ $left -gt 90 ] && B $left --scale s5 --arch full,moba16,moba16_gather,ssa,ssa_gather --remat dots_attn \
      --batch 2 --steps 4 --compile-workers 5 --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_gather.json"
    ;;
  gather2)  # session 8: auto = the gather kernel (one-warp launch); union and fused selection beside it; a profile
    timeout 90 python3 experiments/bench_gather_sparse.py --T 16384 --configs t1w1s2,t1w1s1,t1w1s3,t2w1s2,t1w1s2c128 \
      --out "$OUT/bench_gather_configs.json" 2>&1 | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | grep "^|"
    B 300 --scale s5 --arch full,moba16,moba16_union,moba16_gather_fused,ssa,ssa_gather_fused --remat dots_attn \
      --batch 2 --steps 4 --compile-workers 6 --deadline 285 --out "$OUT/bench_train_s5_gather2.json"
    left=$(( 575 - SECONDS ))
    echo "== $left s left for the S5 moba16 profile"
    [ $left -gt 80 ] && PROF $left moba16
    ;;
  final18)  # session 9: the bf16 split selection checked on the GPU (a short case list), then issue 18's table
    timeout 50 python3 experiments/bench_selection.py --split --no-table --check-impls split@bf16 --check-T 2048 \
      --out "$OUT/bench_selection_check_bf16.json" 2>&1 | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | grep -e "^|" -e Error -e FAIL
    SPARSE18_END=515
    ;&  # then sparse18's steps, in this shell (SECONDS counts the check)
  sparse18)  # issue 18's table from one run: S5 train steps (the selection kept under dots_attn), then decode at 128K
    B 290 --scale s5 --arch full,moba16,ssa --remat dots_attn --batch 2 --steps 4 --compile-workers 3 --deadline 280 \
      --out "$OUT/bench_train_s5_sparse18.json"
    left=$(( ${SPARSE18_END:-530} - SECONDS ))
    echo "== $left s left for decoding at 128K"
    [ $left -gt 40 ] && timeout $left python3 experiments/bench_decode.py --contexts 131072 \
      --layer-archs full,moba,ssa_sparse,swa,lightning --model-archs full,ssa_sparse --model-contexts 131072 \
      --steps 32 --reps 5 --out "$OUT/bench_decode_sparse18.json" 2>&1 | grep -v -e "^W0000" -e "^I0000" -e "^W1201" | tail -20
    ;;
  split18)  # session 9: gate kernel + top-k kernel; the S5 train steps beside the XLA selection; a profile
    timeout 170 python3 experiments/bench_selection.py --split --check-T 4096 --T 16384 --B 2 \
      --out "$OUT/bench_selection_split.json" 2>&1 | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | tail -40
    B 300 --scale s5 --arch full,moba16,moba16_split,ssa,ssa_split --remat dots_attn \
      --batch 2 --steps 4 --compile-workers 3 --deadline 285 --out "$OUT/bench_train_s5_split18.json"
    left=$(( 575 - SECONDS ))
    echo "== $left s left for the S5 moba16_split profile"
    [ $left -gt 80 ] && PROF $left moba16_split
    ;;
  split18b)  # session 9, second call: the split table alone, SSA with the split selection, its profile
    timeout 130 python3 experiments/bench_selection.py --split --no-check --T 16384 --B 2 \
      --out "$OUT/bench_selection_split.json" 2>&1 | grep -v -e "^W1201" -e "^I0000" -e "^W0000" | grep -e "^|" -e Error
    B 230 --scale s5 --arch full,ssa_split --remat dots_attn \
      --batch 2 --steps 4 --compile-workers 2 --deadline 220 --out "$OUT/bench_train_s5_split18b.json"
    left=$(( 580 - SECONDS ))
    echo "== $left s left for the S5 ssa_split profile"
    [ $left -gt 80 ] && PROF $left ssa_split
    ;;
  tune18)  # session 10: bf16 split check; decode on the kernels (check, 128K table, parts); launch sweeps of the
    # split selection's kernels and of the gather kernel (S5 heads, T = 16K, B = 2)
    F() { grep -v -e "^W1201" -e "^I0000" -e "^W0000" -e "^W1202" -e "^I1202"; }
    timeout 150 python3 experiments/bench_selection.py --split --no-table --check-impls split@bf16 --check-T 2048 \
      --out "$OUT/bench_selection_check_bf16.json" 2>&1 | F | grep -e "^|" -e Error -e FAIL -e check
    timeout 90 python3 experiments/bench_decode.py --check --check-archs moba,ssa_sparse \
      --out "$OUT/bench_decode_check.json" 2>&1 | F | tail -4
    timeout 150 python3 experiments/bench_decode.py --contexts 131072 --layer-archs full,moba,ssa_sparse,swa \
      --model-archs full,ssa_sparse --parts --steps 32 --reps 5 --out "$OUT/bench_decode_tune18.json" 2>&1 | F | tail -20
    timeout 120 python3 experiments/bench_selection.py --split --no-check --no-table --T 16384 --B 2 --reps 3 \
      --sweep q16c64w4s2,q16c64w4s2h,q32c64w4s2,q32c64w4s2h,q16c32w4s2,q16c128w4s2,q32c32w4s2,q32c128w4s2,q16c64w2s2,q16c64w8s2,q32c64w8s2,q32c64w8s2h,q16c64w4s1,q16c64w4s3,q32c64w4s3,q32c128w8s2 \
      --sweep-topk r8w4,r4w4,r4w2,r2w2,r8w8,r16w8,r2w1 --out "$OUT/bench_selection_sweep.json" 2>&1 | F | grep -e "^|" -e Error
    left=$(( 570 - SECONDS ))
    echo "== $left s left for the gather kernel's launches"
    [ $left -gt 40 ] && timeout $left python3 experiments/bench_gather_sparse.py --T 16384 --B 2 \
      --configs t1w1s2,t1w1s3,t1w1s3c128,t1w1s2c128,t1w2s3 --out "$OUT/bench_gather_tune18.json" 2>&1 | F | grep -e "^|" -e Error
    ;;
  tune18b)  # session 10, second call: decode on the kernels (parts with launches, profiles, 128K table);
    # the gate kernel's tiles around the best; the S5 SSA step with the tuned defaults against full
    F() { grep -v -e "^W1201" -e "^I0000" -e "^W0000" -e "^W1202" -e "^I1202"; }
    timeout 100 python3 experiments/bench_decode.py --contexts 131072 --layer-archs full,moba,ssa_sparse \
      --model-archs full,ssa_sparse --parts --steps 32 --reps 5 --out "$OUT/bench_decode_tune18b.json" 2>&1 | F | tail -24
    timeout 60 python3 experiments/bench_decode.py --contexts 131072 --steps 32 --profile moba,swa \
      --profile-dir "$OUT/decode_profile" --out "$OUT/bench_decode_profile.json" 2>&1 | F | grep -v "^ *0.000" | head -70
    timeout 60 python3 experiments/bench_selection.py --split --no-check --no-table --T 16384 --B 2 --reps 3 \
      --sweep q16c128w4s2,q16c128w4s2h,q16c256w4s2,q16c128w2s2,q16c128w4s3,q16c256w8s2 \
      --sweep-topk r2w1,r1w1,r4w1 --out "$OUT/bench_selection_sweep2.json" 2>&1 | F | grep -e "^|" -e Error
    left=$(( 575 - SECONDS ))
    echo "== $left s left for the S5 steps"
    B $left --scale s5 --arch full,ssa --remat dots_attn --batch 2 --steps 4 --compile-workers 2 \
      --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_tune18b.json"
    ;;
  final18b)  # session 10: issue 18's table from one run: decode == forward check, the S5 train steps, the decode
    # table at 128K (layers, parts with the decode kernel's launches, models), then the bf16 split check
    F() { grep -v -e "^W1201" -e "^I0000" -e "^W0000" -e "^W1202" -e "^I1202"; }
    timeout 60 python3 experiments/bench_decode.py --check --check-archs full,moba,ssa_sparse \
      --out "$OUT/bench_decode_check.json" 2>&1 | F | grep -e check -e Error
    B 300 --scale s5 --arch full,moba16,ssa --remat dots_attn --batch 2 --steps 4 --compile-workers 3 --deadline 290 \
      --out "$OUT/bench_train_s5_final18b.json"
    left=$(( 520 - SECONDS ))
    echo "== $left s left for decoding at 128K"
    [ $left -gt 40 ] && timeout $left python3 experiments/bench_decode.py --contexts 131072 \
      --layer-archs full,moba,ssa_sparse,swa,lightning --model-archs full,ssa_sparse --model-contexts 131072 \
      --parts --steps 32 --reps 5 --out "$OUT/bench_decode_final18b.json" 2>&1 | F | tail -24
    left=$(( 585 - SECONDS ))
    echo "== $left s left for the bf16 split check"
    [ $left -gt 30 ] && timeout $left python3 experiments/bench_selection.py --split --no-table --check-impls split@bf16 \
      --check-T 2048 --out "$OUT/bench_selection_check_bf16.json" 2>&1 | F | grep -e "^|" -e Error -e FAIL
    ;;
  check18)  # session 10, last call: the GPU checks of the final code (gather kernel's new default launch; decode)
    F() { grep -v -e "^W1201" -e "^I0000" -e "^W0000" -e "^W1202" -e "^I1202"; }
    timeout 100 python3 experiments/bench_decode.py --check --check-archs moba,ssa_sparse \
      --out "$OUT/bench_decode_check.json" 2>&1 | F | grep -e check -e Error
    timeout 110 python3 experiments/bench_gather_sparse.py --check-only --out "$OUT/bench_gather_check.json" 2>&1 \
      | F | tail -12
    ;;
  rest17a|rest17b|rest17c|rest17d)  # issue 17: the cells session 7 did not compile (<= 3 compile workers a process)
    case "$1" in
      rest17a) plan="s2:full,sa_swa,lightning,mamba2,gdn:280 s3:full,swa,sa:240" ;;
      rest17b) plan="s3:sa_swa,lightning,mamba2,gdn:280 s4:full,sa_swa,lightning:240" ;;
      rest17c) plan="s4:mamba2,gdn:230 s5:full,swa,sa_swa:290" ;;
      rest17d) plan="s5:full,lightning,mamba2,gdn:520" ;;
    esac
    for item in $plan; do
      IFS=: read -r scale archs secs <<< "$item"
      B $(( secs + 10 )) --scale $scale --arch $archs --remat dots_attn --batch 8 --steps 5 --compile-workers 3 \
        --deadline $secs --out "$OUT/bench_train_${scale}_$1.json"
    done
    ;;
  s5alone17)  # session 11: the S5 row compiled alone (issue 17's compile target), then two scanned stacks
    B 560 --scale s5 --arch full,swa,sa_swa,lightning,mamba2,gdn,gdn+scan,lightning+scan --remat dots_attn --batch 8 \
      --steps 4 --compile-alone --deadline 540 --out "$OUT/bench_train_s5_alone17.json"
    ;;
  init17)  # session 12, first call: ParamInit against the whole-model init at S5, then S5's linear-mixer
    # steps compiled alone (Lightning's per-layer decay now behind an optimization barrier)
    timeout 200 python3 experiments/compile_init.py --scale s5 --arch full,lightning,gdn --whole lightning \
      --out "$OUT/compile_init_s5.json" 2>&1 | grep -v -e "^W1202" -e "^I1202" -e vocab_size
    left=$(( 565 - SECONDS ))
    echo "== $left s left for S5 lightning, mamba2, gdn compiled alone"
    B $left --scale s5 --arch lightning,mamba2,gdn --remat dots_attn --batch 8 --steps 3 --compile-alone \
      --deadline $(( left - 15 )) --out "$OUT/bench_train_s5_lin.json"
    ;;
  prof17)  # session 13: where the S1 and S3 steps go, at 8 x 16K under dots_attn; one tarball back
    for v in "s1 full" "s1 swa" "s1 sa" "s3 full" "s3 swa"; do
      set -- $v
      d="$OUT/prof17/$1_$2"; mkdir -p "$d"
      echo "== profile $1 $2"
      timeout 105 python3 experiments/profile_train.py --scale "$1" --arch "$2" --batch 8 --remat dots_attn \
        --steps 3 --top 40 --hlo --out-dir "$d" > "$d/log.txt" 2>&1
      # the whole log travels in the tarball; XLA's warnings are counted here, never dropped
      echo "   exit $?, XLA warnings: $(grep -c '^W[0-9]' "$d/log.txt"), folding alarms: $(grep -c 'Constant folding' "$d/log.txt")"
      grep -v -e '^[WI][0-9][0-9][0-9][0-9] ' "$d/log.txt" | head -14 | cut -c1-180
    done
    tar czf "$OUT/prof17.tgz" -C "$OUT" prof17 && rm -rf "$OUT/prof17"; ls -la "$OUT"
    ;;
  xent17)  # session 13: the chunked loss's softmax pass as one Pallas kernel (bench_loss), then the S1/S3 steps
    timeout 150 python3 experiments/bench_loss.py --out "$OUT/bench_loss.json" 2>&1 | grep -v -e "deprecated" | cut -c1-300
    for k in pallas xla; do
      end=515; [ "$k" = pallas ] && end=395
      left=$(( end - SECONDS ))
      echo "== loss_kernel=$k: $left s for S1, S3 x full, swa, sa"
      B $left --scale s1,s3 --arch full,swa,sa --remat dots_attn --batch 8 --steps 5 --compile-workers 4 \
        --gin_param "ModelConfig.loss_kernel = '$k'" --deadline $(( left - 8 )) --out "$OUT/bench_train_xent_$k.json"
    done
    left=$(( 585 - SECONDS ))
    echo "== $left s for S1, S3 full attention on jla's kernel (its outputs saved by dots_attn)"
    [ $left -gt 40 ] && B $left --scale s1,s3 --arch full --impl jla --save-primitive custom_partitioning --remat dots_attn \
      --batch 8 --steps 5 --compile-workers 2 --gin_param "ModelConfig.loss_kernel = 'pallas'" \
      --deadline $(( left - 8 )) --out "$OUT/bench_train_jla_full.json"
    ;;
  prof17b)  # session 13, call 3: where S1 / S3 steps go, by part (each kernel names its HLO instruction), then S5 scan
    for v in "s1 full" "s1 swa" "s3 full"; do
      set -- $v
      d="$OUT/prof17b/$1_$2"; mkdir -p "$d"
      echo "== profile $1 $2 (no command buffers)"
      XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 90 python3 experiments/profile_train.py --scale "$1" \
        --arch "$2" --batch 8 --remat dots_attn --steps 3 --top 40 --hlo --out-dir "$d" > "$d/log.txt" 2>&1
      echo "   exit $?, XLA warnings: $(grep -c '^W[0-9]' "$d/log.txt"), folding alarms: $(grep -c 'Constant folding' "$d/log.txt")"
      grep -v -e '^[WI][0-9][0-9][0-9][0-9] ' "$d/log.txt" | grep -A14 "^by part" | cut -c1-160
    done
    tar czf "$OUT/prof17b.tgz" -C "$OUT" prof17b && rm -rf "$OUT/prof17b"
    left=$(( 585 - SECONDS ))
    echo "== $left s for S5 gdn / sa_swa, scanned and unrolled, each compiled alone"
    B $left --scale s5 --arch gdn+scan,sa_swa+scan,gdn,sa_swa --remat dots_attn --batch 8 --steps 3 --compile-alone \
      --deadline $(( left - 8 )) --out "$OUT/bench_train_s5_scan17.json"
    ;;
  xent17b)  # session 13, call 4: S1-S4 x full/SWA/SA with the loss kernel xla vs pallas, no compile beside a timing
    for k in xla pallas; do
      end=585; [ "$k" = xla ] && end=295
      left=$(( end - SECONDS ))
      echo "== loss_kernel=$k: $left s for S1-S4 x full, swa, sa"
      B $left --scale s1,s2,s3,s4 --arch full,swa,sa --remat dots_attn --batch 8 --steps 5 --compile-workers 6 \
        --time-after-compiles --gin_param "ModelConfig.loss_kernel = '$k'" --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_xent17b_$k.json"
    done
    ;;
  norm17)  # session 14: RMSNorm's one-pass kernels (bench_norm), then S1/S3/S5 x full/SWA steps, norms xla vs pallas
    timeout 150 python3 experiments/bench_norm.py --out "$OUT/bench_norm.json" 2>&1 | grep -v -e "deprecated" | cut -c1-300
    for k in pallas xla; do
      end=590; [ "$k" = pallas ] && end=$(( SECONDS + (590 - SECONDS) / 2 ))
      left=$(( end - SECONDS ))
      echo "== norm_kernel=$k: $left s for S1, S3, S5 x full, swa"
      B $left --scale s1,s3,s5 --arch full,swa --remat dots_attn --batch 8 --steps 4 --compile-workers 6 \
        --time-after-compiles --gin_param "ModelConfig.norm_kernel = '$k'" --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_norm17_$k.json"
    done
    ;;
  mb17)  # session 14: the best micro-batch per (scale, arch) under dots_attn, timed after all compiles
    B 585 --scale s1,s2,s3,s4 --arch full,swa,sa --remat dots_attn --sweep-microbatch 8,16 --steps 4 \
      --compile-workers 6 --time-after-compiles --deadline 575 --out "$OUT/bench_train_mb17.json" \
      --table-out "$OUT/microbatch_h200.json"
    ;;
  lin17)  # session 14: the anchor GPT, then S1-S4 x {SA+SWA, Lightning, Mamba-2, GDN} at 16 x 16K, no compile beside a timing
    timeout 100 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out "$OUT/anchor_gpt.json" \
      2>&1 | grep -v -e "^W1203" -e "^I0000" -e "^W0000"
    left=$(( 560 - SECONDS ))
    B $left --scale s1,s2,s3,s4 --arch sa_swa,lightning,mamba2,gdn --remat dots_attn --batch 16 --steps 4 \
      --compile-workers 6 --time-after-compiles --deadline $(( left - 8 )) --out "$OUT/bench_train_lin17.json"
    ;;
  grp17)  # jla's simple-GLA kernel reading Mamba-2's B/C groups (JLA_GROUPED_KEYS): the GPU test, then S5 / S3 mamba2 steps
    # (session 15 ran it with the flag off by default and --jla-grouped-keys; now on by default)
    JAX_PLATFORMS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_linear_gpu_path.py 2>&1 | tail -5
    for f in --jla-repeated-keys ""; do
      left=$(( 590 - SECONDS )); [ -n "$f" ] && left=$(( left / 2 ))
      echo "== mamba2 ${f:-repeated keys}: $left s"
      B $left --scale s3,s5 --arch mamba2 --remat dots_attn --batch 8 --steps 4 --compile-workers 2 \
        --time-after-compiles $f --deadline $(( left - 8 )) --out "$OUT/bench_train_grp17_$([ -n "$f" ] && echo repeated || echo grouped).json"
    done
    ;;
  sc17)  # session 15: ShortConv's hand-written backward against autodiff (S3/S5 mamba2, gdn), then S5 GDN by part
    for f in --short-conv-autodiff ""; do
      left=$(( 400 - SECONDS )); [ -n "$f" ] && left=$(( left / 2 ))
      echo "== ${f:-short_conv custom VJP}: $left s for S3, S5 x mamba2, gdn"
      B $left --scale s3,s5 --arch mamba2,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 4 \
        --time-after-compiles $f --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_sc17_$([ -n "$f" ] && echo autodiff || echo vjp).json"
    done
    d="$OUT/prof_s5_gdn"; mkdir -p "$d"; left=$(( 590 - SECONDS ))
    echo "== $left s: profile S5 gdn at 8 x 16K by part (no command buffers)"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout $left python3 experiments/profile_train.py --scale s5 \
      --arch gdn --batch 8 --remat dots_attn --steps 2 --top 40 --hlo --out-dir "$d" > "$d/log.txt" 2>&1
    echo "   exit $?"; grep -v -e '^[WI][0-9][0-9][0-9][0-9] ' "$d/log.txt" | grep -A16 "^by part" | cut -c1-160
    tar czf "$OUT/prof_s5_gdn.tgz" -C "$OUT" prof_s5_gdn && rm -rf "$d"
    ;;
  none17)  # session 16: no remat at all (the presets' default) against dots_attn, where memory allows it
    B 585 --scale s1,s2,s3,s4 --arch full@none,swa@none,sa@none,full,swa,sa --remat dots_attn --batch 16 --steps 4 \
      --compile-workers 6 --time-after-compiles --deadline 575 --out "$OUT/bench_train_none17.json"
    ;;
  alone17c)  # session 17 (the last device minutes): S5 GDN and Mamba-2 with the conv kernel, compiled alone
    # under the presets' remat (none) at their micro-batch (4): the compile target
    B 140 --scale s5 --arch gdn,mamba2 --remat none --batch 4 --steps 2 --compile-alone --deadline 132 \
      --out "$OUT/bench_train_alone17c.json"
    ;;
  acc17s5)  # session 17 (the lease's last 5 minutes): S5 full / SWA under dots_attn at 8, one micro-batch vs 2 accumulated
    ACC 300 2 bench_train_acc17s5_ --scale s5 --arch full,swa --remat dots_attn --batch 8 --steps 3 --compile-workers 2
    ;;
  row17c)  # session 17: the anchor; the S1-S4 Mamba-2 / GDN rows with the conv kernel on (auto), at the table's
    # 16 sequences; then S5 Mamba-2 / GDN without remat at 4, one micro-batch vs 4 accumulated per step
    timeout 80 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 4 --out "$OUT/anchor_gpt.json" \
      2>&1 | grep -v -e "^W12" -e "^I0000" -e "^W0000"
    B 240 --scale s1,s2,s3,s4 --arch mamba2,gdn --remat dots_attn --batch 16 --steps 4 --compile-workers 8 \
      --time-after-compiles --deadline 232 --out "$OUT/bench_train_row17c_s1_s4.json"
    ACC 585 4 bench_train_row17c_s5_acc --scale s5 --arch mamba2,gdn --remat none --batch 4 --steps 3 --compile-workers 2
    ;;
  conv17b)  # session 17: ShortConv's backward kernel, second design (rows carried in registers), checked and timed
    # alone, then in the S5 steps at their best setting (no remat, 4 sequences) and S3 (dots_attn, 8)
    timeout 150 python3 experiments/bench_conv.py --out "$OUT/bench_conv_b.json" 2>&1 | grep -v -e "deprecated" | cut -c1-300
    for k in xla pallas; do
      end=590; [ "$k" = xla ] && end=$(( SECONDS + (590 - SECONDS) / 2 ))
      left=$(( end - SECONDS ))
      echo "== conv_kernel=$k: $left s for S5 mamba2/gdn (none, B 4), S3 mamba2/gdn (dots_attn, B 8)"
      B $(( left / 2 )) --scale s5 --arch mamba2,gdn --remat none --batch 4 --steps 4 --compile-workers 2 \
        --time-after-compiles --gin_param "ModelConfig.conv_kernel = '$k'" --deadline $(( left / 2 - 8 )) \
        --out "$OUT/bench_train_conv17b_s5_$k.json"
      left=$(( end - SECONDS ))
      B $left --scale s3 --arch mamba2,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 2 \
        --time-after-compiles --gin_param "ModelConfig.conv_kernel = '$k'" --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_conv17b_s3_$k.json"
    done
    ;;
  gn18)  # session 18: GDN's output norm read in place from jla's padded output, on XLA and on the one-pass kernels;
    # checked and timed alone, then the S5 GDN step at its best setting (no remat, 4 sequences) three ways
    timeout 120 python3 experiments/bench_gated_norm.py --out "$OUT/bench_gated_norm.json" 2>&1 | grep -v -e "deprecated" | cut -c1-300
    left=$(( 585 - SECONDS ))
    echo "== $left s: S5 gdn (padded output, XLA norm) and gdn_norm_pallas, none, B 4"
    B $(( left * 3 / 5 )) --scale s5 --arch gdn,gdn_norm_pallas --remat none --batch 4 --steps 6 --compile-workers 2 \
      --time-after-compiles --deadline $(( left * 3 / 5 - 8 )) --out "$OUT/bench_train_gn18_s5.json"
    left=$(( 585 - SECONDS ))
    echo "== $left s: S5 gdn with the output sliced and cast before the norm (the path before session 18)"
    B $left --scale s5 --arch gdn --remat none --batch 4 --steps 6 --compile-workers 1 --time-after-compiles \
      --gdn-sliced-output --deadline $(( left - 8 )) --out "$OUT/bench_train_gn18_s5_sliced.json"
    ;;
  mbnone18)  # session 18: the presets' remat (none) for the linear mixers and SA+SWA at S1-S4 (the table's @none
    # keys they lack), 8 compiles at a time, timed after all compiles; archs in order, so a deadline cuts the last
    B 580 --scale s1,s2,s3,s4 --arch "${ARCHS18:-mamba2,gdn,lightning,sa_swa}" --order arch --remat none \
      --sweep-microbatch 8,16 --steps 4 --compile-workers 8 --time-after-compiles --deadline 560 \
      --out "$OUT/bench_train_mbnone18.json" --table-out "$OUT/microbatch_none18.json"
    ;;
  mbnone18b)  # session 18, second call: the @none keys still missing after mbnone18 (S5 SA, SA+SWA, Lightning;
    # S2 and S4 full / SWA / SA, whose plain entries were measured under dots_attn)
    B 270 --scale s5 --arch sa,sa_swa,lightning --order arch --remat none --sweep-microbatch 4,8 --steps 4 \
      --compile-workers 6 --time-after-compiles --deadline 260 \
      --out "$OUT/bench_train_mbnone18_s5.json" --table-out "$OUT/microbatch_none18_s5.json"
    left=$(( 575 - SECONDS ))
    echo "== $left s: S2 / S4 x full, swa, sa under remat none at {8, 16}"
    B $left --scale s2,s4 --arch full,swa,sa --order arch --remat none --sweep-microbatch 8,16 --steps 4 \
      --compile-workers 8 --time-after-compiles --deadline $(( left - 10 )) \
      --out "$OUT/bench_train_mbnone18_s24.json" --table-out "$OUT/microbatch_none18_s24.json"
    ;;
  acc18)  # session 18: S4's step as a run takes it (global batch 64 = 4 micro-batches of 16 without remat)
    ACC 330 4 bench_train_acc18_s4_ --scale s4 --arch full,swa,sa --remat none --batch 16 --steps 3 --compile-workers 3
    ;;
  final19a|final22a)  # session 19 (again in 22): issue 17's table from one lease, part 1: the anchor GPT, then S1-S4 x 7 archs under the
    # presets' remat (none), each at the micro-batch the rule gives it (configs/microbatch_h200.json), timed after all compiles
    timeout 100 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out "$OUT/anchor_gpt_a.json" \
      2>&1 | grep -v -e "^W1204" -e "^I0000" -e "^W0000"
    left=$(( 575 - SECONDS ))
    echo "== $left s: S1-S4 x 7 archs, remat none, --batch rule"
    B $left --scale s1,s2,s3,s4 --arch $ARCHS --remat none --batch rule --steps 4 --compile-workers 8 \
      --time-after-compiles --deadline $(( left - 10 )) --out "$OUT/bench_train_${1}_s1_s4.json"
    ;;
  final19b|final22b)  # part 2: S5 x 7 archs (none, rule = 4), S5 full / SWA under dots_attn at 8 (their best setting), the anchor
    B 330 --scale s5 --arch $ARCHS --remat none --batch rule --steps 4 --compile-workers 4 --time-after-compiles \
      --deadline 320 --out "$OUT/bench_train_${1}_s5.json"
    left=$(( 470 - SECONDS ))
    echo "== $left s: S5 full / SWA, dots_attn at 8"
    B $left --scale s5 --arch full,swa --remat dots_attn --batch 8 --steps 4 --compile-workers 2 --time-after-compiles \
      --deadline $(( left - 8 )) --out "$OUT/bench_train_${1}_s5_dots_attn.json"
    left=$(( 585 - SECONDS ))
    timeout $left python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out "$OUT/anchor_gpt_b.json" \
      2>&1 | grep -v -e "^W1204" -e "^I0000" -e "^W0000"
    ;;
  alone19)  # session 19, fourth call: the compile target (S5, alone) for every arch under the presets' remat at 4
    B 570 --scale s5 --arch full,swa,sa,lightning,mamba2,gdn,sa_swa --remat none --batch 4 --steps 2 --compile-alone \
      --deadline 555 --out "$OUT/bench_train_alone19_s5.json"
    ;;
  ct20)  # session 20: where an S5 compile's time goes (profile_train.py --compile-trace: host self time by
    # event), for the three archs above 60 s alone, then GDN compiled alone and timed with XLA's Triton GEMMs off vs on
    for a in gdn mamba2 sa_swa; do
      echo "== compile trace: s5 $a (none, B 4)"
      CT 120 $a 30 s5_$a
    done
    left=$(( 565 - SECONDS )); half=$(( left / 2 ))
    echo "== $left s: S5 GDN alone, Triton GEMMs off, then on"
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false B $half --scale s5 --arch gdn --remat none --batch 4 --steps 3 \
      --compile-alone --out "$OUT/bench_train_ct20_gdn_notriton.json"
    left=$(( 570 - SECONDS ))
    B $left --scale s5 --arch gdn --remat none --batch 4 --steps 3 --compile-alone --out "$OUT/bench_train_ct20_gdn.json"
    ;;
  ct20b)  # session 20: S5 GDN (none, B 4) compiled alone and timed, one process per XLA setting: as runs take it;
    # without the latency-hiding scheduler; without the autotuner (level 0); the per-fusion autotune cache that
    # JAX enables beside its compilation cache, first cold, then warm (a new program whose fusions were tuned before)
    i=0
    for flags in "" --xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_autotune_level=0 \
        --xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc --xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc; do
      i=$(( i + 1 )); left=$(( 575 - SECONDS )); [ $left -lt 60 ] && break
      echo "== [$i] XLA_FLAGS='$flags' ($left s left)"
      XLA_FLAGS="$flags" B $(( left < 110 ? left : 110 )) --scale s5 --arch gdn --remat none --batch 4 --steps 3 \
        --compile-alone --out "$OUT/bench_train_ct20b_$i.json" | grep -E "^s5 |rror|Traceback" | tail -6
    done
    ;;
  ct20c)  # session 20: the optimised HLO of the S5 GDN and SA+SWA steps (none, B 4) beside their compile traces
    for a in gdn sa_swa; do
      echo "== compile trace + HLO: s5 $a"
      CT 200 $a 12 ct20c_s5_$a --hlo; cp /tmp/ct_ct20c_s5_$a/hlo_*.txt.gz "$OUT/"
    done
    ;;
  ct20d)  # session 20: which compile phases hold the wall clock (profile_train's wall_s) for S5 GDN and Mamba-2
    for a in gdn mamba2; do
      echo "== compile trace (wall per phase): s5 $a"
      CT 200 $a 40 ct20d_s5_$a
    done
    ;;
  ct20e)  # session 20: does the per-fusion autotune cache (JAX turns it on beside its compilation cache) remove the
    # autotuner's pass (`config-assigner`) from a new process's compile? Traced cold, then warm
    for run in cold warm; do
      echo "== compile trace, autotune cache $run: s5 gdn"
      XLA_FLAGS=--xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc CT 200 gdn 14 ct20e_s5_gdn_$run
    done
    ls /tmp/atc | head -3; echo "$(find /tmp/atc -type f | wc -l) files in the autotune cache"
    ;;
  scan20)  # written in session 20: scan_layers' compile and step cost for the three archs whose S5 compile passes 60 s
    # on slow hosts, under the presets' remat (none) at 4 (session 13 measured it under dots_attn at 8: 5-7% step)
    B 575 --scale s5 --arch gdn,gdn+scan,mamba2,mamba2+scan,sa_swa,sa_swa+scan --remat none --batch 4 --steps 3 \
      --compile-alone --deadline 560 --out "$OUT/bench_train_scan20_s5.json"
    ;;
  acc21)  # session 21: S3 full / SWA / SA as a run takes the step (global batch 48 = 3 micro-batches of 16, remat none),
    # then S5 GDN (none, B 4) as runs take it against the same step without the q/k L2 norms (BOUNDPY; went NaN)
    ACC 300 3 bench_train_acc21_s3_ --scale s3 --arch full,swa,sa --remat none --batch 16 --steps 3 --compile-workers 3
    BOUND_GDN acc21 as_run no_qk_l2norm
    ;;
  prof21)  # session 21: S5 GDN (none, B 4) profiled by part as runs take it and without the q/k norms, whose step
    # ran 0.883x in acc21: the profile showed every kernel faster on its NaN data (not the norms' cost; see bound21);
    # trace and optimised HLO come back for an offline split (profile_train --summarize)
    for v in as_run no_qk_l2norm; do
      echo "== profile s5 gdn ($v)"
      XLA_FLAGS=--xla_gpu_enable_command_buffer= BOUNDPY 280 $v experiments/profile_train.py --scale s5 --arch gdn \
        --batch 4 --remat none --steps 2 --top 25 --hlo --out-dir "/tmp/prof21_$v" 2>&1 \
        | grep -v -e "^W0000" -e "^I0000" -e "^W1204" -e gin_param | tail -45
      cp /tmp/prof21_$v/trace_*.json.gz "$OUT/prof21_${v}_trace.json.gz"
      cp /tmp/prof21_$v/hlo_*.txt.gz "$OUT/prof21_${v}_hlo.txt.gz"
      cp /tmp/prof21_$v/profile_summary.json "$OUT/prof21_${v}_summary.json"
    done
    ;;
  bound21)  # session 21: the q/k L2 norms' cost with finite data: S5 GDN (none, B 4) as runs take it, then with the
    # norms replaced by a constant scale (qk_scaled); bench_train marks a NaN loss (status nonfinite_loss)
    BOUND_GDN bound21 as_run qk_scaled
    ;;
  power21)  # session 21: does a GEMM's speed depend on its operands' values (normal, init-scale, zeros, NaN)? SM clock
    # and power sampled by nvidia-smi while each runs (the NaN train step of acc21 ran 0.883x)
    timeout 200 python3 experiments/bench_data_power.py --size 8192 --seconds 8 --out "$OUT/bench_data_power.json" 2>&1 \
      | grep -v -e "^W1204" -e "^I0000" -e "^W0000"
    ;;
  h100fit22)  # session 22, on an H100 (75.2 GiB at fraction 0.95): the rule's micro-batch fitted to the device's memory
    # (train.microbatch.fit_to_memory; final22a ran S3 / S4 out of memory at the H200's entries), S3-S4 then S5 x 7 archs
    B 330 --scale s3,s4 --arch $ARCHS --remat none --batch rule --steps 3 --compile-workers 8 --time-after-compiles \
      --deadline 320 --out "$OUT/bench_train_h100fit22_s3_s4.json"
    left=$(( 585 - SECONDS ))
    echo "== $left s: S5 x 7 archs, --batch rule on this device"
    B $left --scale s5 --arch $ARCHS --remat none --batch rule --steps 3 --compile-workers 7 --time-after-compiles \
      --deadline $(( left - 10 )) --out "$OUT/bench_train_h100fit22_s5.json"
    ;;
  mbsparse)  # session 19 (written in 18): the presets' MoBA (configs/arch/moba.gin, label moba16, keyed
    # `moba` by the rule) and SSA at S1-S4 without remat, the last archs without micro-batch entries
    B 580 --scale s1,s2,s3,s4 --arch moba16,ssa --order arch --remat none --sweep-microbatch 8,16 --steps 4 \
      --compile-workers 8 --time-after-compiles --deadline 560 \
      --out "$OUT/bench_train_mbsparse.json" --table-out "$OUT/microbatch_sparse.json"
    ;;
  mbnone17)  # session 16: the presets' remat (none): the best micro-batch at S1 and S3, timed after all compiles
    B 330 --scale s1,s3 --arch full,swa,sa --remat none --sweep-microbatch 8,16 --steps 4 \
      --compile-workers 8 --time-after-compiles --deadline 200 --out "$OUT/bench_train_mbnone17.json" \
      --table-out "$OUT/microbatch_none.json"
    ;;
  s5none17)  # session 16: S5 without remat fits 4 x 16K; against dots_attn at 4 and at 8 (the table's micro-batch)
    B 330 --scale s5 --arch full@none,swa@none,mamba2@none,gdn@none,full,mamba2,gdn --remat dots_attn --batch 4 \
      --steps 4 --compile-workers 7 --time-after-compiles --deadline 320 --out "$OUT/bench_train_s5none17_b4.json"
    left=$(( 540 - SECONDS ))
    echo "== $left s for S5 full / mamba2 / gdn at 8 x 16K under dots_attn"
    B $left --scale s5 --arch full,mamba2,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 3 \
      --time-after-compiles --deadline $(( left - 8 )) --out "$OUT/bench_train_s5none17_b8.json"
    ;;
  conv17)  # session 16: ShortConv's backward kernel (check, launches, conv alone), then S3/S5 mamba2 / gdn steps xla vs pallas
    timeout 150 python3 experiments/bench_conv.py --out "$OUT/bench_conv.json" 2>&1 | grep -v -e "deprecated" | cut -c1-300
    for k in xla pallas; do
      end=590; [ "$k" = xla ] && end=$(( SECONDS + (590 - SECONDS) / 2 ))
      left=$(( end - SECONDS ))
      echo "== conv_kernel=$k: $left s for S3, S5 x mamba2, gdn"
      B $left --scale s3,s5 --arch mamba2,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 4 \
        --time-after-compiles --gin_param "ModelConfig.conv_kernel = '$k'" --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_conv17_$k.json"
    done
    ;;
  row17)  # session 15: the anchor, then S5 and S1-S4 x {Mamba-2, GDN} under this session's defaults
    # (jla reads Mamba-2's B/C groups; ShortConv's hand-written backward), each at its table micro-batch
    timeout 80 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 4 --out "$OUT/anchor_gpt.json" \
      2>&1 | grep -v -e "^W1203" -e "^I0000" -e "^W0000"
    B 130 --scale s5 --arch mamba2,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 2 \
      --time-after-compiles --deadline 122 --out "$OUT/bench_train_row17_s5.json"
    left=$(( 385 - SECONDS ))
    echo "== $left s for S1-S4"
    B $left --scale s1,s2,s3,s4 --arch mamba2,gdn --remat dots_attn --batch 16 --steps 4 --compile-workers 8 \
      --time-after-compiles --deadline $(( left - 6 )) --out "$OUT/bench_train_row17_s1_s4.json"
    ;;
  ce17)  # jla's fused LM-head loss (ModelConfig.loss_kernel = 'jla') against the chunked loss on our kernel
    timeout 180 python3 experiments/bench_loss.py --kernels pallas,jla --launches 1:2048:4 --out "$OUT/bench_loss_jla.json" \
      2>&1 | grep -v -e "deprecated" | cut -c1-300
    for k in pallas jla; do
      end=590; [ "$k" = pallas ] && end=$(( SECONDS + (590 - SECONDS) / 2 ))
      left=$(( end - SECONDS ))
      echo "== loss_kernel=$k: $left s for S1, S3, S5 full"
      B $left --scale s1,s3,s5 --arch full --remat dots_attn --batch 8 --steps 4 --compile-workers 3 \
        --time-after-compiles --gin_param "ModelConfig.loss_kernel = '$k'" --deadline $(( left - 8 )) \
        --out "$OUT/bench_train_ce17_$k.json"
    done
    ;;
  table17)  # session 12, call 2: issue 17's table at S1-S4 x 7 archs (8 x 16K, dots_attn) with the anchor GPT
    timeout 110 python3 experiments/anchor_gpt.py --seq-len 16384 --batch 8 --steps 5 --out "$OUT/anchor_gpt.json" \
      2>&1 | grep -v -e "^W1202" -e "^I0000" -e "^W0000"
    left=$(( 570 - SECONDS ))
    echo "== $left s left for S1-S4"
    B $left --scale s1,s2,s3,s4 --arch $ARCHS --remat dots_attn --batch 8 --steps 5 --compile-workers 4 \
      --deadline $(( left - 10 )) --out "$OUT/bench_train_s1_s4_table.json"
    ;;
  s5cp17)  # session 12, call 3: the S5 row (2 compiles at a time), then dots_attn also saving jla's kernel outputs
    B 330 --scale s5 --arch $ARCHS --remat dots_attn --batch 8 --steps 4 --compile-workers 2 --deadline 320 \
      --out "$OUT/bench_train_s5_table.json"
    left=$(( 570 - SECONDS ))
    echo "== $left s left for swa, lightning, gdn with custom_partitioning saved"
    B $left --scale s5 --arch swa,lightning,gdn --remat dots_attn --batch 8 --steps 4 --compile-workers 2 \
      --save-primitive custom_partitioning --deadline $(( left - 10 )) --out "$OUT/bench_train_s5_cp.json"
    ;;
  cpl17)  # session 12, call 4: S5 Lightning with and without jla's kernel outputs saved, one process each
    B 125 --scale s5 --arch lightning --remat dots_attn --batch 8 --steps 5 --compile-alone --deadline 115 \
      --out "$OUT/bench_train_s5_lightning.json"
    B 125 --scale s5 --arch lightning --remat dots_attn --batch 8 --steps 5 --compile-alone --deadline 115 \
      --save-primitive custom_partitioning --out "$OUT/bench_train_s5_lightning_cp.json"
    ;;
  s5lin17)  # session 11, second call: S5's linear-mixer rows, strictly one variant at a time (lower, compile, time)
    B 540 --scale s5 --arch lightning,mamba2,gdn --remat dots_attn --batch 8 --steps 3 --compile-alone \
      --deadline 520 --out "$OUT/bench_train_s5_lin17.json"
    ;;
  ops17)  # session 11, third call: S5's linear-attention ops compiled alone (is the kernel the slow compile?)
    for item in lightning:auto:150 mamba2:auto:110 gdn:auto:110 lightning:xla:60; do
      IFS=: read -r arch impl secs <<< "$item"
      timeout $secs python3 experiments/compile_ops.py --scale s5 --arch $arch --impl $impl --batch 8 \
        --out "$OUT/compile_ops_${arch}_${impl}.json" 2>&1 | grep -v -e "^W1202" -e "^I1202" -e vocab_size
      echo "== $arch $impl rc ${PIPESTATUS[0]} at ${SECONDS} s"
    done
    ;;
  why17)  # session 11, last call: which change makes the S5 Lightning step compile? 4 processes at once, compile only
    export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.2  # over the limit: compiled, not run
    for v in "lightning dots_attn" "lightning@dots dots" "lightning+scan dots_attn" "lightning@dots_attn xla"; do
      set -- $v
      extra=(); [ "$2" = xla ] && extra=(--gin_param "ModelConfig.linear_impl = 'xla'")
      B 140 --scale s5 --arch $1 --remat dots_attn --batch 8 --steps 2 --compile-alone --deadline 130 "${extra[@]}" \
        --out "$OUT/bench_train_s5_why17_${1//[@+]/_}_$2.json" > "$OUT/why17_${1//[@+]/_}_$2.log" 2>&1 &
    done
    wait; tail -n 3 "$OUT"/why17_*.log
    ;;
  profile)
    timeout 200 python3 experiments/profile_train.py --scale s3 --arch full --batch 8 \
      --steps 3 --out-dir "$OUT/profile" 2>&1 | grep -v -e "^W0000" -e "^I0000" | tail -40
    ;;
  *) echo "usage: $0 table|s5|remat|sparse|all7a|all7b|gather|gather2|sparse18|split18|split18b|final18|tune18|tune18b|final18b|check18|rest17a-d|s5alone17|s5lin17|ops17|why17|profile"; exit 2 ;;
esac
date -u +"end %Y-%m-%dT%H:%M:%SZ"

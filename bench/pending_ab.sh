#!/usr/bin/env bash
# The A/B runs for a GPU, one or more phases a `device` call (each call under 10 minutes; logs and JSON under
# $OUT/<phase>/, the settings' table printed last). Which session ran which phase, on which card, and what
# came of it: docs/gpu-notes.md, a section a session (a phase's note below says when it last ran).
# Prepare on the CPU machine first: `bash bench/device_prep.sh` (carry [".whl", ".fixtures"]).
#
#   bash bench/pending_ab.sh nextkernels  # (run in session 60 on an H200, 7.3 min; in 59 on an H100) the
#                                      # suites with the next GEMV's prefetch off, on for every NVRTC GEMV, and
#                                      # on for all but the tensor-core il32 kernel (main's default since; IQ3_S;
#                                      # Q4_K off / on), then IQ3_S's 4-column step and 1-8 lanes as graphed
#                                      # rounds under the three
#   bash bench/pending_ab.sh q4after   # (run in session 61, H100: staged at 8 columns gains, the default
#                                      # since) q4il staged at every width, in clusters at every width, against
#                                      # the defaults, now that its CTAs no longer sum the activation (~5 min)
#   bash bench/pending_ab.sh skips     # (run in session 61, H100, ~5 min) the graphed rounds without the
#                                      # recurrence, the gated norm, both, the norms, SwiGLU: what each small
#                                      # kernel costs (both types, 1 / 8 lanes)
#   bash bench/pending_ab.sh dataflow  # (run in session 65, H100: the launches win) a chain of 64 fp16 GEMVs
#                                      # a launch each (plain, PDL) against one launch with barriers and one
#                                      # dataflow launch (bench/dataflow_chain.py; ~1 min)
#   bash bench/pending_ab.sh argmax    # (run in session 72, H100: inside +0.2 %, the default stays) a greedy round's argmax inside the decode graph against torch's
#                                      # after it (NINFER_GRAPH_ARGMAX=0): GPU tests, Q4_K tg128 A B A B
#                                      # in the engine's loop (~3 min)
#   bash bench/pending_ab.sh tglead    # the plain bench's Q4_K tg128 at bf16 / fp32 compute, the Q4_K suite
#                                      # at fp32: why the plain bench decodes ~1.2 % faster (~3 min)
#   bash bench/pending_ab.sh skips8    # IQ3_S's graphed rounds at 1 / 8 lanes without the norms, the
#                                      # recurrence; the norm's columns a program, a program a row (~5 min)
#   bash bench/pending_ab.sh norm8     # (run in session 72, H100: the defaults hold) the same at its cheapest: 8 lanes, a program a row or not (~3 min)
#   bash bench/pending_ab.sh defaults72  # session 72's defaults (the side stream at 1 lane, graphs of 16 / 64
#                                      # pages) against session 71's: GPU tests, tg128 in the suite's engine
#                                      # (both types, alternating in one process; ~4 min)
#   bash bench/pending_ab.sh pool      # (run in session 74, H100) the 9B workspace test's graph pool at two / one widths, side 4 / 1;
#                                      # the verification-round graph tests (~4 min)
#   bash bench/pending_ab.sh spans     # (run in sessions 73-75, H100: IQ3_S 2 columns gains, 4 loses) the
#                                      # GDN conv of a verification's spans in the GEMV epilogue against
#                                      # the conv kernel: GPU tests, the 4- and 2-column steps (~5 min)
#   bash bench/pending_ab.sh side2     # (run in session 73, H100: 4 lanes gain) the side stream at 2 and 4 lanes: graphs of up to 1 / 2 / 4 lanes
#                                      # deferring the GDN state write (~3 min)
#   bash bench/pending_ab.sh side      # (run in session 72, H100: 1 lane gains) the GDN state write on a side stream of the decode graph: its GPU
#                                      # tests, both types' rounds at 1 / 8 lanes off / on / on with 132
#                                      # programs (~5 min)
#   bash bench/pending_ab.sh tglead2   # (run in session 72, H100: the widths +0.26 %, the default) Q4_K tg128 under the plain bench's engine and the suite's, the latter
#                                      # at 8 splits at most and with graphs by page-table width (~5 min)
#   bash bench/pending_ab.sh h200      # on an H200: both suites, q4il's next-GEMV prefetch at 4-32 MiB (~6 min)
#   bash bench/pending_ab.sh h200c     # (run in session 68, H200: the defaults stay) q4il's prefetch at 4-32
#                                      # MiB, IQ3_S's kernels' prefetch at 1 / 8 lanes (~2.5 min)
#   bash bench/pending_ab.sh h200b     # (run in session 68, H200: the defaults hold) sessions 61-63's H100
#                                      # defaults against their alternatives (the one-group norm, the gated
#                                      # norm's warps, the page prefetch, q4il staged at 8 columns; ~2 min)
#   bash bench/pending_ab.sh prologue  # (run in session 68, H200: the two kernels gain, the default) a decode
#                                      # graph's first launches as two kernels (the RoPE tables, the round's
#                                      # addresses) against PyTorch's eleven: their GPU tests, both types'
#                                      # graphed rounds at 1 / 8 lanes (~4 min)
#   bash bench/pending_ab.sh prologue1 # the same at its cheapest: Q4_K's 1-lane round, the argmax (~2 min)
#   bash bench/pending_ab.sh attnpf    # (run in session 63, H100: even) the decode attention's pages asked
#                                      # into L2 before its wait (NINFER_ATTN_PREFETCH_MIB=0 / default / 64):
#                                      # GPU tests, rounds at 512 and 16K (~5 min)
#   bash bench/pending_ab.sh contend   # Q4_K's graphed rounds with and without the norms, under the next
#                                      # GEMV's prefetch off and q4il unstaged: what slows its norms (~3 min)
#   bash bench/pending_ab.sh small     # (run in session 61, H100: four warps the default since) the gated
#                                      # norm's warps; the norm a group a program at 4 columns (loses)
#   bash bench/pending_ab.sh normone   # (run in session 61, H100: the default at 1-2 rows since) the decode
#                                      # norm a program a group of 256 against 512 columns a program (Q4_K)
#   bash bench/pending_ab.sh recur     # (run in session 61, H100: the defaults stay) the recurrence's tiles,
#                                      # the conv GEMV's prefetch off (Q4_K, 1 / 8 lanes)
#   bash bench/pending_ab.sh lanetrace # both types' graphed rounds by kernel name at 1 and 8 lanes (~3 min)
#   bash bench/pending_ab.sh nextfine  # (run in session 59, H100) 4 against 8 MiB; at 8 MiB none from the
#                                      # GEMV that runs the GDN conv of 2-8 lanes, the recurrence's state
#                                      # evict-first, or spread over the next launch's first tiles; the
#                                      # fixtures' greedy runs with it (~7 min)
#   bash bench/pending_ab.sh next      # (run in session 58, H100) each GEMV asks the next one's first weight
#                                      # bytes into L2 as its CTAs finish (NINFER_NEXT_PREFETCH=KB): its GPU
#                                      # test; both types' rounds at 1 and 8 lanes, IQ3_S's 4-column step, at
#                                      # 0 / 2 / 8 MiB (~4 min)
#   bash bench/pending_ab.sh nextsize  # (run in session 58, H100) 8 MiB against 16, 32 and 64 (~3 min)
#   bash bench/pending_ab.sh evict3    # (run in session 57) both il32 kernels at 2 against none: IQ3_S rounds
#                                      # at 1 and 8 lanes, the 4-column step (~2 min)
#   bash bench/pending_ab.sh evict2    # (its settings run in session 57) every NVRTC GEMV's weight loads not
#                                      # kept in L1 (NINFER_EVICT=1), also evict-first in L2 (2), Q4_K's head
#                                      # alone at 2 (~5 min)
#   bash bench/pending_ab.sh evict     # (run in session 56) level 2's GPU twin tests; both types at 0 / 2
#   bash bench/pending_ab.sh ahead0    # (run in session 56: before the wait wins) the dp4a il32 kernel's first
#                                      # block after its wait vs before (IQ3_S rounds at 1, 2, 8 lanes); q4il
#                                      # unstaged vs staged at 1-2 lanes (~4 min)
#   bash bench/pending_ab.sh cluster   # q4il's cluster GPU tests; its clusters (default at 1-2 columns on an H200)
#                                      # vs none at 1-8 lanes and 4 columns (~4 min)
#   bash bench/pending_ab.sh gaps      # decode rounds' sync-free test; the suite's rounds (each graph's GPU time,
#                                      # the time between graphs) at its context, at 4,096, with the decode
#                                      # attention's programs uncapped; caps as graphed rounds, the 4-column
#                                      # step too (~9 min)
#   bash bench/pending_ab.sh trace     # a graphed 1-lane round kernel by kernel, Q4_K then IQ3_S (~2 min)
#   bash bench/pending_ab.sh alloc     # the Q4_K suite with the allocator's expandable segments (peak reserved)
#   bash bench/pending_ab.sh tests     # the GPU tests of the conv epilogue, prefill pieces, staged q4il
#   bash bench/pending_ab.sh staged    # only the staged build's GPU twin tests (q4il)
#   bash bench/pending_ab.sh q4staged  # NINFER_Q4IL_STAGED=0 / 1: Q4_K rounds at 1-8 lanes, 4 columns, alone
#   bash bench/pending_ab.sh conv      # NINFER_LANE_CONV_COLUMNS=1 vs 8 (both types' rounds) + q4il alone
#   bash bench/pending_ab.sh memory    # prefill pieces A/B, the memory probe (the 27B)
#   bash bench/pending_ab.sh workspace # test_workspace.py's GPU tests, the memory probe at 16 MiB headroom (the
#                                      # 9B: default allocator, expandable segments; the 27B), stranded bytes
#                                      # by site (~6 min)
#   bash bench/pending_ab.sh gpu       # every GPU-marked test, 14 at a time (~4 min)
#   bash bench/pending_ab.sh suites    # both suites (gpu_bench.sh) under the defaults as they stand (first on
#                                      # an H200: session 60's q4il sums from the producers are untimed there)
#   bash bench/pending_ab.sh fp16      # both suites with fp16 GDN states (session 76, H100: IQ3_S's C = 8 /
#                                      # C = 1 5.28x -> 5.42x; untimed on an H200)
#   bash bench/pending_ab.sh sampling  # (session 79, H200: the presets 3-4 % under greedy; session 80, H100:
#                                      # the kernels, thinking 0.4 %; session 81, H100: the device-kept
#                                      # penalties, non-thinking 1.5 %) the sampler's GPU tests; its device time, two kernels against PyTorch's ops
#                                      # (bench/sampler_timing.py); decode with greedy and the presets' sampling at
#                                      # 1 / 4 lanes, both samplers (bench/tg_sampling.py, both types; ~6 min)
#
# A setting becomes a default only where its graphed rounds gain (min of two replays, A B B A); a faster
# 1-lane round alone lowers C = 8 / C = 1.
# Several phases run in one call in their order (`pending_ab.sh staged q4staged`), each under $OUT/<phase>/.
# `suites` and `fp16` take WTYPES (default both types: `WTYPES=q4_k bash bench/pending_ab.sh suites fp16`).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASES="sampling, fp16, pool, spans, side2, defaults72, side, dataflow, argmax, tglead, tglead2, skips8, norm8, h200, h200b, h200c, prologue, prologue1, attnpf, contend, small, normone, recur, skips, q4after, lanetrace, next, nextsize, nextfine, nextkernels, evict3, evict2, evict, ahead0, cluster, gaps, trace, alloc, tests, staged, q4staged, conv, memory, workspace, gpu or suites"
[ $# -gt 0 ] || { echo "phases: $PHASES"; exit 2; }
ROOT=${OUT:-/tmp/ninfer-pending}
PACK=${OUT:+1}  # a device call's $OUT (packed at the end, below)
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
export NINFER_SHARED=${NINFER_SHARED:-$PWD/.fixtures/shared}
mkdir -p "$ROOT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | tee "$ROOT/gpu.txt"

# step NAME SECONDS COMMAND...: run under a time limit, its output in $OUT/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -4 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || echo "== $name: exit status $rc (124: timed out)"
}

# the graphed rounds of the 27B under each setting (bench/step_profile.py --sweep), JSON in $OUT/NAME/
sweep() {
  local name=$1 wtype=$2 limit=$3 settings=$4
  shift 4
  step "$name" "$limit" "$PY" bench/step_profile.py --wtype "$wtype" --prompt 512 --no-rate --sweep "$settings" \
    --out "$OUT/$name" "$@"
}

# phase NAME: one phase's steps, its logs under $ROOT/NAME/
phase() {
  OUT=$ROOT/$1
  mkdir -p "$OUT"
  case $1 in
    ahead0)
      # nothing before the wait (session 55: more before it lost): the dp4a kernel's first block after it;
      # q4il unstaged (its first block after the wait) against staged (one before it)
      sweep ahead0_iq3_s iq3_s 200 NINFER_IL_AHEAD=1,NINFER_IL_AHEAD=0 --lanes 1,2,8
      sweep ahead0_q4_k q4_k 200 NINFER_Q4IL_STAGED=1,NINFER_Q4IL_STAGED=0 --lanes 1,2
      ;;
    evict)
      # the NVRTC GEMVs' weight loads not kept in L1 and evict-first in L2 (gemv_il.evict_level 2): their GPU
      # twin tests under it, then both types' rounds (session 56, H100: IQ3_S 1 lane -0.15 ms, Q4_K +0.08)
      NINFER_EVICT=2 step pytest 240 "$PY" -m pytest -m gpu -n 8 -p xdist --dist worksteal -v -rfE -k \
        "twin or clusters or every_width" tests/test_gemv_il.py tests/test_gemv_q4il.py tests/test_gemv_q6il.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      sweep evict_iq3_s iq3_s 200 NINFER_EVICT=0,NINFER_EVICT=2 --lanes 1,2,8
      sweep evict_q4_k q4_k 200 NINFER_EVICT=0,NINFER_EVICT=2 --lanes 1,2,8
      ;;
    next)
      step pytest 240 "$PY" -m pytest -m gpu -n 4 -p xdist --dist worksteal -v -rfE -k "next_gemvs" \
        tests/test_gemv_il.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      sweep next_iq3_s iq3_s 240 NINFER_NEXT_PREFETCH=0,NINFER_NEXT_PREFETCH=2048,NINFER_NEXT_PREFETCH=8192 \
        --lanes 1,8
      sweep next_c4 iq3_s 150 NINFER_NEXT_PREFETCH=0,NINFER_NEXT_PREFETCH=2048,NINFER_NEXT_PREFETCH=8192 --columns 4
      sweep next_q4_k q4_k 240 NINFER_NEXT_PREFETCH=0,NINFER_NEXT_PREFETCH=2048,NINFER_NEXT_PREFETCH=8192 \
        --lanes 1,8
      ;;
    nextsize)
      # how much: 8 MiB against 16, 32, 64 (the next GEMV's bytes cap it)
      sweep size_iq3_s iq3_s 240 NINFER_NEXT_PREFETCH=8192,NINFER_NEXT_PREFETCH=16384,NINFER_NEXT_PREFETCH=32768,\
NINFER_NEXT_PREFETCH=65536 --lanes 1,8
      sweep size_q4_k q4_k 240 NINFER_NEXT_PREFETCH=8192,NINFER_NEXT_PREFETCH=16384,NINFER_NEXT_PREFETCH=32768,\
NINFER_NEXT_PREFETCH=65536 --lanes 1,8
      sweep size_c4 iq3_s 120 NINFER_NEXT_PREFETCH=8192,NINFER_NEXT_PREFETCH=32768 --columns 4
      ;;
    nextfine)
      # 4 / 8 MiB; at 8 MiB none from the GEMV that runs the GDN conv of 2-8 lanes (the recurrence's state
      # traffic comes next), the recurrence's state evict-first (what was prefetched may stay), or the 8 MiB
      # spread over the starts of the tiles the next launch starts on
      sweep fine_iq3_s iq3_s 200 NINFER_NEXT_PREFETCH=4096,NINFER_NEXT_PREFETCH=8192,\
NINFER_NEXT_PREFETCH=8192+NINFER_NEXT_PREFETCH_CONV_LANES=1,NINFER_NEXT_PREFETCH=8192+NINFER_GDN_STATE_EVICT=1,\
NINFER_NEXT_PREFETCH=8192+NINFER_NEXT_PREFETCH_SPREAD=1 --lanes 1,8
      sweep fine_q4_k q4_k 200 NINFER_NEXT_PREFETCH=4096,NINFER_NEXT_PREFETCH=8192,\
NINFER_NEXT_PREFETCH=8192+NINFER_NEXT_PREFETCH_CONV_LANES=1,NINFER_NEXT_PREFETCH=8192+NINFER_GDN_STATE_EVICT=1,\
NINFER_NEXT_PREFETCH=8192+NINFER_NEXT_PREFETCH_SPREAD=1 --lanes 1,8
      # the fixture models' greedy runs with it, and its own test
      NINFER_NEXT_PREFETCH=8192 step pytest 150 "$PY" -m pytest -m gpu -n 8 -p xdist --dist worksteal -v -rfE \
        -k "greedy or next_gemvs" tests/test_gemv_il.py tests/test_kernels_gpu.py tests/test_models_quantized.py tests/test_graph_decode.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      ;;
    nextkernels)
      # session 59 (H100 suites): on everywhere, IQ3_S's 4-column step +3 % and C = 4 -2.2 % (the tensor-core
      # il32 kernel at 4 columns) where everything else gains; the same without that kernel's prefetch
      for setting in 0 8192 il=8192:q4il=8192:q6il=8192; do
        for wtype in iq3_s q4_k; do
          [ "$wtype" = q4_k ] && [ "${setting#il=}" != "$setting" ] && continue  # (Q4_K: no il32 GEMV)
          NINFER_NEXT_PREFETCH=$setting WTYPES=$wtype SUITE_TIMEOUT_S=150 OUT=$OUT/suite_${setting//[=:]/_} \
            bash bench/gpu_bench.sh 2>&1 | grep -E "^== |tg128 \(|4-column|decode C=|C=8 / C=1"
        done
      done
      sweep kernels_c4 iq3_s 120 NINFER_NEXT_PREFETCH=0,NINFER_NEXT_PREFETCH=8192,\
NINFER_NEXT_PREFETCH=il=8192:q4il=8192:q6il=8192 --columns 4
      sweep kernels_lanes iq3_s 200 NINFER_NEXT_PREFETCH=0,NINFER_NEXT_PREFETCH=8192,\
NINFER_NEXT_PREFETCH=il=8192:q4il=8192:q6il=8192 --lanes 1,2,4,8
      ;;
    evict3)
      # both il32 kernels at 2 (session 56's default) against none: IQ3_S rounds, 4 columns
      sweep evict3_iq3_s iq3_s 200 NINFER_EVICT=0,NINFER_EVICT=il=2:il_mma=2 --lanes 1,8
      sweep evict3_c4 iq3_s 120 NINFER_EVICT=0,NINFER_EVICT=il=2:il_mma=2 --columns 4
      ;;
    evict2)
      # which hint gains where: not kept in L1 alone (1) against both (2); Q4_K's head alone at 2
      sweep evict2_iq3_s iq3_s 240 NINFER_EVICT=0,NINFER_EVICT=1,NINFER_EVICT=2 --lanes 1,8
      sweep evict2_q4_k q4_k 240 NINFER_EVICT=0,NINFER_EVICT=1,NINFER_EVICT=q6il=2 --lanes 1,2
      ;;
    q4after)
      # with the activation sums from the producers (session 60) q4il starts its math right after the wait:
      # do staging at 8 columns (off since session 50: +0.03 ms then) and clusters past 2 columns (8: +0.4 ms
      # in session 52) still lose? Q4_K's graphed rounds, the default against each forced on
      sweep q4after_staged q4_k 200 NINFER_Q4IL_STAGED=,NINFER_Q4IL_STAGED=1 --lanes 1,4,8
      sweep q4after_cluster q4_k 200 NINFER_Q4IL_CLUSTER=,NINFER_Q4IL_CLUSTER=2 --lanes 1,2,4,8
      ;;
    skips)
      # what each small kernel still costs the graphed rounds (left out: outputs wrong, an upper bound on what
      # fusing it away could gain; session 37's last sweep: the recurrence 0.36 ms, the norms 0.15, the gated
      # norm nothing), Q4_K then IQ3_S at 1 and 8 lanes
      for wtype in q4_k iq3_s; do
        sweep "skips_$wtype" "$wtype" 280 skip=,skip=gdn_decode._recurrent_kernel,\
skip=fused._gated_norm_heads_kernel,skip=gdn_decode._recurrent_kernel:fused._gated_norm_heads_kernel,\
skip=fused._norm_kernel,skip=fused._swiglu_kernel --lanes 1,8
      done
      ;;
    skips8)
      # (session 69) what the norms and the recurrence cost IQ3_S's 8-lane round (C = 8 / C = 1 asks 0.11 ms of
      # it; session 61's H100 sweep put the norms at 0.28-0.42 ms there against 0.07 at one lane), the decode
      # norm at 1,024 columns a program and a program a row from 3 rows (NINFER_NORM_SPLIT_ROWS=2), also at the
      # 4-column step; first the GPU test of the graphs captured again after a clear (~5 min)
      step skips8_tests 120 "$PY" -m pytest -q -m gpu tests/test_graph_decode.py -k replay_equals_eager
      sweep skips8_iq3_s iq3_s 280 skip=,skip=fused._norm_kernel,skip=gdn_decode._recurrent_kernel,\
norm=1024,NINFER_NORM_SPLIT_ROWS=2 --lanes 1,8
      sweep skips8_iq3_s_4 iq3_s 120 NINFER_NORM_SPLIT_ROWS=,NINFER_NORM_SPLIT_ROWS=2 --columns 4
      ;;
    norm8)
      # skips8 at its cheapest (~3 min): the recapture's GPU test, IQ3_S's 8-lane round with the decode norm a
      # program a row from 3 rows (sm_90 build: 2,784 instructions, 25 barriers, 126 registers — likely
      # slower), a program a group of 256 (808, 6, 40; slower on an H100 in session 61), the default (512
      # columns: 968, 14, 61) and without the norms
      step norm8_tests 90 "$PY" -m pytest -q -m gpu tests/test_graph_decode.py -k replay_equals_eager
      sweep norm8_iq3_s iq3_s 240 NINFER_NORM_SPLIT_ROWS=,NINFER_NORM_SPLIT_ROWS=2,NINFER_NORM_ONE_GROUP=1,\
skip=fused._norm_kernel --lanes 8
      ;;
    recur)
      # the recurrence's tiles again (value columns : warps a program, at 1 and 8 lanes alike; the defaults
      # 16:1 at one lane, 32:4 at more) and the conv GEMV's prefetch of the next GEMV's weights off at one lane
      # too (its 8 MiB meet the recurrence's state loads), Q4_K
      sweep recur_q4_k q4_k 280 NINFER_NEXT_PREFETCH_CONV_LANES=8,gdn=16:1:256,gdn=32:4:256,gdn=8:1:256,\
gdn=32:1:256,gdn=32:2:256,gdn=64:4:256,NINFER_NEXT_PREFETCH_CONV_LANES=0 --lanes 1,8
      ;;
    small)
      # the two-head gated norm on 1 / 2 / 4 warps (one: ~840 instructions in a chain; more: fewer
      # each, 11-13 barriers; Q4_K's costs it 0.056 ms a 1-lane round, IQ3_S's a head a program 0.012); the
      # decode norm a program a group of 256 at one lane's 4 positions (default: 1-2 rows only)
      sweep small_gated q4_k 200 NINFER_GATED_NORM_WARPS=1,NINFER_GATED_NORM_WARPS=2,NINFER_GATED_NORM_WARPS=4 \
        --lanes 1,8
      sweep small_norm4 q4_k 120 NINFER_NORM_ONE_GROUP=,NINFER_NORM_ONE_GROUP=1 --columns 4
      ;;
    dataflow)
      # a chain of 64 dependent fp16 GEMVs (the 27B's row counts, 16 layers of four) as a launch each (plain, PDL)
      # against one persistent kernel whose warps start the next GEMV's rows on the input chunks already
      # written, and one whose warps wait for each GEMV's whole input (bench/dataflow_chain.py): what the launch
      # boundaries cost, the inner loop the same
      # (run in session 65 on H100s: the PDL launches fastest at every setting, dataflow +2.6 µs a GEMV, the
      # barriers +2.8-6.6, the light release / acquire forms slower still)
      step dataflow 200 "$PY" bench/dataflow_chain.py --rpw 2,4 --unroll 4
      # shorter GEMVs (16-32 MB: the boundaries a larger share)
      step dataflow_small 150 "$PY" bench/dataflow_chain.py --inner 1536,3072 --layers 32
      cat "$OUT/dataflow.log" "$OUT/dataflow_small.log"
      ;;
    h200)
      # the first H200 since session 60: both suites on today's code, then how much q4il asks of the next GEMV
      # there (8 MiB since session 58, sized on an H100; the H200 asks twice the bytes in flight), Q4_K
      WTYPES="iq3_s q4_k" SUITE_TIMEOUT_S=200 OUT=$OUT bash bench/gpu_bench.sh
      sweep h200_size q4_k 200 NINFER_NEXT_PREFETCH=q4il=8192,NINFER_NEXT_PREFETCH=q4il=4096,\
NINFER_NEXT_PREFETCH=q4il=16384,NINFER_NEXT_PREFETCH=q4il=32768 --lanes 1,8
      ;;
    argmax)
      # (session 68) a greedy round's argmax inside the decode graph (the head's cast with each 2,048-column
      # chunk's maximum in one launch, the rows' choice in a second) against torch's cast in the graph and its
      # memset + reduction after it (NINFER_GRAPH_ARGMAX=0): the GPU tests, then Q4_K's tg128 in the engine's
      # own loop (ninfer-bench, a process a setting, A B A B; ~3 min)
      step argmax_tests 200 "$PY" -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_graph_decode.py \
        -k "argmax or graph or lookahead"
      for run in 1 2; do
        for v in 0 1; do
          step "argmax_tg_${v}_$run" 150 env NINFER_GRAPH_ARGMAX=$v "$PY" -m ninfer.cli.bench --device cuda \
            --synthetic 27b --wtype q4_k -p 512 -n 128 -r 5
        done
      done
      grep -H "tg128" "$OUT"/argmax_tg_*.log
      ;;
    tglead)
      # (session 68's lead) the plain bench's Q4_K tg128 (fp32 compute, one lane, 640 tokens) 198.2-198.5
      # against the suite's 195.9 (bf16, 8 lanes, ~16.6K): the plain bench at both dtypes, then the Q4_K suite
      # at fp32 (~3 min)
      for dt in bfloat16 float32; do
        step "tglead_$dt" 150 "$PY" -m ninfer.cli.bench --device cuda --synthetic 27b --wtype q4_k --dtype "$dt" \
          -p 512 -n 128 -r 5
      done
      WTYPES=q4_k DTYPE=float32 SUITE_TIMEOUT_S=200 OUT=$OUT bash bench/gpu_bench.sh
      grep -H "tg128" "$OUT"/tglead_*.log
      ;;
    side)
      # (session 71; run in 72 on an H100: gains at 1 lane, loses at 8 — the default at 1 lane since) the GDN
      # recurrence's state write off the decode chain: the recurrence leaves k, δ and the decay, a side stream
      # of the graph writes the states (gdn_decode.STATE_SIDE_LANES; 0 off, 8 every graph here). Its
      # GPU tests (the deferred write bit for bit, graph replays with it against eager rounds), then both
      # types' graphed rounds at 1 / 8 lanes off, on (a program a tile), on with 132 programs (~5 min)
      step side_tests 200 "$PY" -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_graph_decode.py \
        -k "gdn_decode_on_gpu or graph_replay"
      grep -E "passed|failed|error" "$OUT/side_tests.log" | tail -3
      sweep side_q4_k q4_k 200 NINFER_GDN_STATE_SIDE=0,NINFER_GDN_STATE_SIDE=8,\
NINFER_GDN_STATE_SIDE=8+NINFER_GDN_STATE_SIDE_PROGRAMS=132 --lanes 1,8
      sweep side_iq3_s iq3_s 200 NINFER_GDN_STATE_SIDE=0,NINFER_GDN_STATE_SIDE=8,\
NINFER_GDN_STATE_SIDE=8+NINFER_GDN_STATE_SIDE_PROGRAMS=132 --lanes 1,8
      ;;
    pool)
      # (session 73) the 9B workspace test's decode graphs' pool against its plan at two page-table widths (70 /
      # 50 MiB in session 74's first run, H100; 48 / 70 at one width, 68 / 67 with the side stream at one lane:
      # the modelled plan, replaced since by captures over the throwaway pools): the test at the default
      # widths, at one (NINFER_GRAPH_WIDTHS=""), and with the side stream at one lane, each capture's growth
      # printed; then the span conv's GPU tests and the verification-round graph tests (20 passed in session
      # 74's first run; ~3 min)
      for setting in "" "NINFER_GRAPH_WIDTHS=" "NINFER_GDN_STATE_SIDE=1"; do
        step "pool_${setting%%=*}" 150 env $setting "$PY" -m pytest -q -m gpu -s tests/test_workspace.py -k auto_kv
        grep -E "graph pool|memory \(|passed|failed" "$OUT/pool_${setting%%=*}.log" | tail -12
      done
      step pool_spans 240 "$PY" -m pytest -q -m gpu -n 8 -p xdist tests/test_graph_decode.py tests/test_gemv_il.py \
        -k "conv or replay"
      grep -E "passed|failed|error" "$OUT/pool_spans.log" | tail -3
      ;;
    spans)
      # (run in sessions 73-75, H100: the dp4a kernel's gains, the tensor-core one's loses; =1 is every
      # kernel's since) the GDN conv of a verification's spans in the input projection's epilogue (the il32 and
      # q4il kernels, gemv_il.LANE_CONV_SPANS) against the conv kernel: its GPU tests, then the graphed
      # 4-column step of both types and IQ3_S's 2-column one (the dp4a kernel) under each (~5 min)
      step spans_tests 200 "$PY" -m pytest -q -m gpu -n 8 -p xdist tests/test_gemv_il.py tests/test_graph_decode.py \
        tests/test_kernels_gpu.py -k "conv or gdn_decode_on_gpu"
      grep -E "passed|failed|error" "$OUT/spans_tests.log" | tail -3
      sweep spans_c4_iq3_s iq3_s 150 NINFER_LANE_CONV_SPANS=0,NINFER_LANE_CONV_SPANS=1 --columns 4
      sweep spans_c2_iq3_s iq3_s 120 NINFER_LANE_CONV_SPANS=0,NINFER_LANE_CONV_SPANS=1 --columns 2
      sweep spans_c4_q4_k q4_k 120 NINFER_LANE_CONV_SPANS=0,NINFER_LANE_CONV_SPANS=1 --columns 4
      ;;
    side2)
      # (session 72) the side stream's lane limit between the measured ends (1 lane gains, 8 lose): graphs of
      # up to 1 / 2 / 4 lanes deferring, both types' rounds at 2 and 4 lanes (~3 min)
      sweep side2_q4_k q4_k 150 NINFER_GDN_STATE_SIDE=1,NINFER_GDN_STATE_SIDE=2,NINFER_GDN_STATE_SIDE=4 --lanes 2,4
      sweep side2_iq3_s iq3_s 150 NINFER_GDN_STATE_SIDE=1,NINFER_GDN_STATE_SIDE=2,NINFER_GDN_STATE_SIDE=4 \
        --lanes 2,4
      ;;
    defaults72)
      # (session 72) the defaults it set — the GDN state on a side stream at one lane, graphs of 16 / 64 pages —
      # against session 71's: their GPU tests, then each type's tg128 in the suite's engine (8 lanes, 16,576
      # tokens), old and new alternating in one process (~4 min)
      step defaults72_tests 150 "$PY" -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_graph_decode.py \
        -k "gdn_decode_on_gpu or graph_replay"
      grep -E "passed|failed|error" "$OUT/defaults72_tests.log" | tail -3
      step defaults72_q4_k 200 "$PY" bench/tg_engine.py --wtype q4_k --shapes 8:16576:o,8:16576,1:640
      tail -5 "$OUT/defaults72_q4_k.log"
      step defaults72_iq3_s 200 "$PY" bench/tg_engine.py --wtype iq3_s --shapes 8:16576:o,8:16576
      tail -4 "$OUT/defaults72_iq3_s.log"
      ;;
    tglead2)
      # (session 69) tglead on an H100: the plain bench bf16 162.87 / fp32 161.51, the suite at fp32 160.5 — not
      # the dtype. The engine's shape then: 1 lane at 640 tokens' context (the plain bench's), 8 lanes at
      # 16,576 (the suite's), the latter with its decode attention at 8 splits at most (64: 5 of them hold a
      # 512-token chat's pages) and with graphs of 16- and 64-page tables beside its own (graphs.GRAPH_WIDTHS,
      # off by default until this runs); one process (~5 min; untimed: sessions 69-70 got no machine for it)
      step tglead2 480 "$PY" bench/tg_engine.py --wtype q4_k --shapes 1:640,8:16576,8:16576:8,8:16576:w
      tail -8 "$OUT/tglead2.log"
      ;;
    h200c)
      # (session 68) the H200 without the suites: q4il's next-GEMV prefetch at 4-32 MiB (Q4_K), and IQ3_S's
      # C = 8 / C = 1 (4.959x, short): the il kernels' and the head's prefetch, off on the H200, at 1 / 8 lanes
      sweep h200c_q4_k q4_k 200 NINFER_NEXT_PREFETCH=q4il=8192,NINFER_NEXT_PREFETCH=q4il=4096,\
NINFER_NEXT_PREFETCH=q4il=16384,NINFER_NEXT_PREFETCH=q4il=32768 --lanes 1,8
      sweep h200c_iq3_s iq3_s 260 NINFER_NEXT_PREFETCH=q4il=8192,NINFER_NEXT_PREFETCH=il=8192,\
NINFER_NEXT_PREFETCH=il_mma=8192,NINFER_NEXT_PREFETCH=q6il=8192,NINFER_NEXT_PREFETCH=il=8192:il_mma=8192 --lanes 1,8
      ;;
    h200b)
      # the defaults sessions 61-63 chose on H100s, each against its alternative on the H200 (one model load a
      # type): the norm a program a group at 1-2 rows (H100 -0.03 ms), the gated norm on four warps (-0.044),
      # the decode attention's page prefetch (even), q4il staged at 8 columns (8 lanes -0.17)
      sweep h200b_q4_k q4_k 280 NINFER_NORM_ONE_GROUP=,NINFER_NORM_ONE_GROUP=0,NINFER_GATED_NORM_WARPS=1,\
NINFER_ATTN_PREFETCH_MIB=0,NINFER_Q4IL_STAGED=0 --lanes 1,8
      sweep h200b_iq3_s iq3_s 200 NINFER_ATTN_PREFETCH_MIB=,NINFER_ATTN_PREFETCH_MIB=0 --columns 4
      ;;
    prologue)
      # NINFER_ROUND_KERNELS=0: the RoPE tables and GraphDecodeContext.begin()'s addresses as PyTorch's ops
      # (5 + 6 launches at the start of every decode graph, none under PDL) instead of one kernel each (the
      # embedding's gather inside its decode launch either way: not in the A/B)
      step prologue_tests 200 "$PY" -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_graph_decode.py \
        -k "round_inputs or embedding_rows or graph or lookahead"
      sweep prologue_q4_k q4_k 200 NINFER_ROUND_KERNELS=0,NINFER_ROUND_KERNELS=1 --lanes 1,8
      sweep prologue_iq3_s iq3_s 150 NINFER_ROUND_KERNELS=0,NINFER_ROUND_KERNELS=1 --lanes 1
      step prologue_argmax 60 "$PY" bench/argmax_timing.py  # the greedy argmax and the logits' cast
      ;;
    prologue1)
      # the prologue A/B at its cheapest (~2 min): Q4_K's 1-lane graphed round, the argmax and cast
      sweep prologue1_q4_k q4_k 150 NINFER_ROUND_KERNELS=0,NINFER_ROUND_KERNELS=1
      step prologue1_argmax 40 "$PY" bench/argmax_timing.py
      ;;
    attnpf)
      # each decode attention program asks its pages into L2 before its PDL wait (9 µs an attention layer at
      # 512 tokens on the chain, its bytes < 1 µs; session 62: the 4-column step -0.046 ms, the rest even; on
      # since, capped at PREFETCH_BYTES a launch): the GPU tests, Q4_K's rounds at 1 / 8 lanes, IQ3_S's
      # 4-column step, Q4_K's 1-lane round at 16K tokens
      step attnpf_tests 150 "$PY" -m pytest -q -m gpu tests/test_kernels_gpu.py -k paged
      sweep attnpf_q4_k q4_k 200 NINFER_ATTN_PREFETCH_MIB=0,NINFER_ATTN_PREFETCH_MIB= --lanes 1,8
      sweep attnpf_c4 iq3_s 120 NINFER_ATTN_PREFETCH_MIB=0,NINFER_ATTN_PREFETCH_MIB= --columns 4
      # (the round on the lane's own slot at 16K tokens: its "own slots" row; the default budget asks nothing
      # there, 64 MiB all of a layer's pages)
      sweep attnpf_16k q4_k 240 NINFER_ATTN_PREFETCH_MIB=,NINFER_ATTN_PREFETCH_MIB=64 --prompt 16384 \
        --max-context 16520 --lanes 1
      ;;
    contend)
      # what slows the decode norm before q4il (0.18 ms of Q4_K's 1-lane round, IQ3_S's 0.07; q4il's CTAs made
      # to fit beside it cost more, session 62): the norms left out or not, with the next GEMV's prefetch
      # off, with q4il's first block not staged before its wait (session 62 also ran NINFER_NORM_LATE=1, the
      # norm letting the next kernel launch at its end: +0.18 ms, IQ3_S +0.24; the knob is gone)
      sweep contend_q4_k q4_k 280 skip=,skip=fused._norm_kernel,NINFER_NEXT_PREFETCH=0,\
NINFER_NEXT_PREFETCH=0+skip=fused._norm_kernel,NINFER_Q4IL_STAGED=0,NINFER_Q4IL_STAGED=0+skip=fused._norm_kernel \
        --lanes 1,8
      ;;
    normone)
      # the decode norm quantising in groups of 256 a program a group (rows of 32: 5 barriers) against 512
      # columns as [2, 256] (17): its GPU tests, Q4_K's graphed rounds (IQ3_S's norms, groups of 32, cost
      # a third of Q4_K's in session 61's skips)
      step normone_tests 200 "$PY" -m pytest -q -m gpu -x tests/test_fused_ops.py tests/test_kernels_gpu.py \
        -k "norm or int8 or fused or producer"
      sweep normone_q4_k q4_k 200 NINFER_NORM_ONE_GROUP=0,NINFER_NORM_ONE_GROUP=1 --lanes 1,2,8
      ;;
    lanetrace)
      # the graphed rounds' kernels by name at one and at eight lanes (busy µs a profiled round): what the
      # 8-lane round spends beyond the 1-lane one, kernel by kernel (C = 8 / C = 1)
      for wtype in iq3_s q4_k; do
        for lanes in 1 8; do
          step "lanetrace_${wtype}_$lanes" 150 "$PY" bench/step_profile.py --wtype "$wtype" --prompt 512 \
            --timeline --steps 4 --lanes "$lanes"
        done
      done
      ;;
    trace)
      for wtype in q4_k iq3_s; do
        step "trace_$wtype" 150 "$PY" bench/step_profile.py --wtype "$wtype" --prompt 512 --timeline --steps 4 \
          --trace 100
      done
      ;;
    cluster)
      step pytest 240 "$PY" -m pytest -m gpu -n 4 -p xdist --dist worksteal -v -rfE -k "clusters or twin_on_gpu" \
        tests/test_gemv_q4il.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      sweep cluster_lanes q4_k 240 NINFER_Q4IL_CLUSTER=1,NINFER_Q4IL_CLUSTER=2 --lanes 1,2,4,8
      sweep cluster_c4 q4_k 150 NINFER_Q4IL_CLUSTER=1,NINFER_Q4IL_CLUSTER=2 --columns 4
      ;;
    gaps)
      step pytest 120 "$PY" -m pytest -m gpu -v -rfE -k "synchronise or lookahead" tests/test_graph_decode.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      # the suite's rounds at its context (16,520; the decode attention at most DECODE_PROGRAMS programs), at
      # 4,096, and uncapped
      for run in "suite:" "ctx4096:--max-context 4096" "uncapped:--attn-programs 0"; do
        # shellcheck disable=SC2086
        step "gaps_${run%%:*}" 150 "$PY" bench/round_gaps.py --wtype q4_k --lanes 1,8 ${run#*:}
        grep "^|" "$OUT/gaps_${run%%:*}.log"
      done
      sweep attn_q4_k q4_k 300 attn=2:64:0,attn=2:64:512,attn=2:64:128 --lanes 1,2,4,8 --max-context 16520
      # the verification step: 4 query rows of one lane (1,024 programs uncapped)
      sweep attn_c4 iq3_s 150 attn=2:64:0,attn=2:64:512,attn=2:64:128 --columns 4 --max-context 16520
      ;;
    alloc)
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WTYPES=q4_k SUITE_TIMEOUT_S=280 OUT=$OUT bash bench/gpu_bench.sh
      ;;
    tests)
      step pytest 540 "$PY" -m pytest -m gpu -n 12 -p xdist --dist worksteal -v -rfE -k \
        "conv or prefill or greedy or twin or workspace or staged" tests/test_gemv_il.py tests/test_graph_decode.py \
        tests/test_kernels_gpu.py tests/test_workspace.py tests/test_gemv_q4il.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      ;;
    staged)
      step pytest 240 "$PY" -m pytest -m gpu -n 8 -p xdist --dist worksteal -v -rfE -k "twin" tests/test_gemv_q4il.py
      grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
      ;;
    conv)
      sweep conv_iq3_s iq3_s 200 NINFER_LANE_CONV_COLUMNS=1,NINFER_LANE_CONV_COLUMNS=8 --lanes 1,2,4,8
      sweep conv_q4_k q4_k 200 NINFER_LANE_CONV_COLUMNS=1,NINFER_LANE_CONV_COLUMNS=8 --lanes 1,2,4,8
      step q4il_conv 150 "$PY" bench/q4il_timing.py --widths 4,8 --conv
      ;;
    q4staged)
      sweep q4staged_lanes q4_k 200 NINFER_Q4IL_STAGED=0,NINFER_Q4IL_STAGED=1 --lanes 1,2,4,8
      sweep q4staged_c4 q4_k 120 NINFER_Q4IL_STAGED=0,NINFER_Q4IL_STAGED=1 --columns 4
      step q4il_staged 150 "$PY" bench/q4il_timing.py --widths 1,4,8 --staged
      ;;
    memory)
      step prefill_pieces 240 "$PY" bench/prefill_profile.py --wtype iq3_s --tokens 2048 \
        --pieces 8192,1073741824 --no-profile --out "$OUT"
      step memory_probe 240 "$PY" bench/memory_probe.py --wtype q4_k --chunk 2048 --headroom-mib 1024 \
        --prompt 16384 --decoders 7
      ;;
    workspace)
      # the memory plan at 16 MiB headroom (the workspace test failed in session 53: the allocator's slack,
      # planned since session 54): test_workspace.py's GPU tests, the 9B probe under the default allocator
      # and expandable segments, the 27B's
      step workspace 240 "$PY" -m pytest -m gpu -v -rfE tests/test_workspace.py
      for conf in default expandable_segments:True; do
        if [ "$conf" = default ]; then
          unset PYTORCH_CUDA_ALLOC_CONF
        else
          export PYTORCH_CUDA_ALLOC_CONF=$conf
        fi
        step "probe_9b_${conf//[:.]/_}" 120 "$PY" bench/memory_probe.py --synthetic 9b --wtype iq3_s \
          --chunk 1024 --headroom-mib 16 --prompt 2048 --decoders 7 --stranded
      done
      unset PYTORCH_CUDA_ALLOC_CONF
      step probe_27b 200 "$PY" bench/memory_probe.py --synthetic 27b --wtype iq3_s --chunk 2048 \
        --headroom-mib 16 --prompt 8192 --decoders 7 --stranded
      grep -h "memory (cuda\|out of memory:" "$OUT"/probe_*.log
      ;;
    gpu)
      step pytest 560 "$PY" -m pytest -m gpu -n 14 -p xdist --dist worksteal -rfE tests/
      grep -E "passed|failed" "$OUT/pytest.log" | tail -3
      ;;
    suites)
      WTYPES="${WTYPES:-iq3_s q4_k}" SUITE_TIMEOUT_S=280 OUT=$OUT bash bench/gpu_bench.sh
      ;;
    sampling)
      step pytest 120 "$PY" -m pytest -m gpu -rfE tests/test_sampler.py
      step sampler_timing 120 "$PY" bench/sampler_timing.py
      grep "^|" "$OUT/sampler_timing.log"
      for w in ${WTYPES:-q4_k iq3_s}; do
        step "tg_$w" 320 "$PY" bench/tg_sampling.py --wtype "$w"
        grep "^|" "$OUT/tg_$w.log"
      done
      ;;
    fp16)
      # both suites with fp16 GDN states (the SPEC's serving line passes --gdn-state-fp16; the default is fp32):
      # session 76 on an H100, IQ3_S: C = 8 / C = 1 5.28x -> 5.42x
      WTYPES="${WTYPES:-iq3_s q4_k}" SUITE_TIMEOUT_S=280 OUT=$OUT bash bench/gpu_bench.sh --gdn-state-fp16
      ;;
    *)
      echo "unknown phase $1: $PHASES"
      ;;
  esac
}

for name in "$@"; do
  phase "$name"
done

# the settings' table: each sweep's graphed rounds (ms, the min of two), the fastest of a row marked
"$PY" - "$ROOT" <<'EOF'
import json, sys
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("*/*/step_profile_*.json")):
    sweep = json.loads(path.read_text()).get("sweep_ms", {})
    settings = [k for k in sweep if " " not in k]
    rows = sorted({k[len(s):] for s in settings for k in sweep if k == s or k.startswith(s + " ")})
    print(f"\n{path.parent.name} (ms a graphed round)\n| round | " + " | ".join(settings) + " |")
    print("|---" * (len(settings) + 1) + "|")
    for row in rows:
        values = [sweep.get(s + row) for s in settings]
        best = min(v for v in values if v is not None)
        cells = [("—" if v is None else f"**{v:.3f}**" if v == best else f"{v:.3f}") for v in values]
        print(f"| {row.strip() or '1 lane'} | " + " | ".join(cells) + " |")
EOF

# the device tool brings back 8 files of $OUT at most: a run that wrote more leaves them as one archive there
# (`tar -xzf pending.tar.gz`; session 77 lost a suite's JSON to the count)
if [ -n "$PACK" ] && [ "$(find "$ROOT" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/pending.tar.gz -C "$ROOT" . && find "$ROOT" -mindepth 1 -delete && mv /tmp/pending.tar.gz "$ROOT/"
fi

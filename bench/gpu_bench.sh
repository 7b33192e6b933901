#!/usr/bin/env bash
# Issue 5's benchmark table on the GPU machine: `ninfer-bench --suite issue5` on the synthetic 27B, IQ3_S then
# Q4_K, one process per weight type (each: copy-bandwidth check, memory, pp512 + tg128, 4-/1-column step,
# C=1/2/4/8 aggregate decode, pp8192, tg128 at 16K depth). Rows stream into $OUT/suite-27b-<wtype>.log as
# they are measured and $OUT/suite-27b-<wtype>.json is rewritten after every row, so a time-out keeps data.
#
#   bash bench/gpu_bench.sh                     # both types, ~4 min each at most (SUITE_TIMEOUT_S)
#   WTYPES=q4_k REPS=1 bash bench/gpu_bench.sh --kv-dtype rk8v4   # extra flags pass through to ninfer-bench
#   DEVICE=cpu GEOMETRY=tiny DTYPE=float32 WTYPES=q4_k bash bench/gpu_bench.sh --suite-scale 0.005 -n 4 \
#       --prefill-chunk 32 --concurrency 1,2                     # smoke test of this script on a CPU machine
#
# Wheels in .whl/ (fla-core, gguf: the GPU image has neither) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ninfer-bench}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
status=0
for wtype in ${WTYPES:-iq3_s q4_k}; do
  name=suite-${GEOMETRY:-27b}-$wtype
  echo "== synthetic ${GEOMETRY:-27b} $wtype"
  timeout "${SUITE_TIMEOUT_S:-280}" "$PY" -m ninfer.cli.bench --synthetic "${GEOMETRY:-27b}" --wtype "$wtype" \
    --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --suite issue5 -r "${REPS:-2}" \
    --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $wtype: exit status $rc (124: timed out; the rows above were kept)"; status=1; }
done
exit $status

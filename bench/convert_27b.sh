#!/usr/bin/env bash
# Benchmark: convert the synthetic 27B IQ3_S GGUF (with MTP) and compare with a plain cp of the same file.
# Usage: bench/convert_27b.sh [WORKDIR]   (default /tmp; needs ~35 GiB free there; deletes its files at the end)
# Prints the cp wall time (also with sync), the conversion wall time and peak RSS (/usr/bin/time -v).
set -euo pipefail
WORK=${1:-/tmp}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHARED=${NINFER_SHARED:-$REPO/../shared}
HF=$SHARED/fixtures/qwen35-tiny/hf
SRC=$WORK/q35-27b-iq3s.gguf
OUT=$WORK/q35-27b-iq3s.ninfer
PY=${PYTHON:-python3}
trap 'rm -f "$SRC" "$SRC.copy" "$OUT" "$OUT.conversion.json"' EXIT

df -h "$WORK"
[ -f "$SRC" ] || "$PY" "$SHARED/tools/synth_qwen35_gguf.py" --preset 27b --wtype iq3_s --out "$SRC"
ls -l "$SRC"
sync                    # no write-back of the generated file during the timed runs
cat "$SRC" > /dev/null  # warm the page cache the same way for both runs

t0=$(date +%s.%N); cp "$SRC" "$SRC.copy"; t1=$(date +%s.%N); sync; t2=$(date +%s.%N)
echo "cp: $(echo "$t1 - $t0" | bc) s (cp + sync: $(echo "$t2 - $t0" | bc) s)"
rm -f "$SRC.copy"; sync

# No config.json: the recipe derives the text config from the GGUF header; the tokenizer files are the
# fixture's (the synthetic file has no tokenizer), passed as --resource.
RES=()
for f in tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
  RES+=(--resource "$f=$HF/$f")
done
cat "$SRC" > /dev/null  # the cp above evicted part of the source from the page cache: warm it again
/usr/bin/time -v "$PY" -m ninfer.convert --recipe qwen3_8_27b_gguf \
  --source gguf="$SRC" --source mtp="$SRC" --components text,mtp "${RES[@]}" \
  --rows-per-chunk 512 --name synthetic-27b --out "$OUT" --force 2> "$WORK/convert_27b.time" || {
  cat "$WORK/convert_27b.time"; exit 1; }
sync
grep -E "^(wrote|warning)" "$WORK/convert_27b.time" || true
grep -E "Elapsed \(wall clock\)|Maximum resident set size" "$WORK/convert_27b.time"
ls -l "$OUT"
"$PY" -m ninfer.inspect "$OUT" | head -20

#!/usr/bin/env bash
# Several device_session.sh part lists at once, one lane per GPU of a multi-GPU machine, so one device call does the
# work of several (the machine's start is paid once). Every lane stops at the deadline; everything the lanes wrote
# comes back as one archive, $OUT/results.tgz (the device tool returns at most 8 files).
#   bash benchmarks/device_lanes.sh SECONDS "tests kernels" "e2e-small e2e-wide"   # lane 0 on GPU 0, lane 1 on GPU 1
# A lane of "multi-gpu" needs every GPU: give it alone.
set -u
deadline=$1; shift
OUT=$(realpath -m "${OUT:-device_out}")
work=/tmp/lanes
rm -rf "$work" && mkdir -p "$work" "$OUT"
. benchmarks/device_env.sh
gpu=0
for parts in "$@"; do
  lane="$work/lane$gpu"
  mkdir -p "$lane"
  pin=()
  [ $# -gt 1 ] && pin=(env CUDA_VISIBLE_DEVICES=$gpu)  # one lane alone keeps every GPU
  # shellcheck disable=SC2086  # parts is a word list on purpose
  OUT="$lane" "${pin[@]}" timeout "$deadline" bash benchmarks/device_session.sh $parts \
    > "$lane/summary.txt" 2>&1 &
  gpu=$((gpu + 1))
done
wait
tar czf "$OUT/results.tgz" -C "$work" .
for summary in "$work"/lane*/summary.txt; do
  echo "##### $summary"
  grep -v '^\s*$' "$summary" | tail -n 60
done

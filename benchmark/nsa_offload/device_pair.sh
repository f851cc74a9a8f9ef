#!/bin/bash
# Two device_run.sh jobs side by side on a 2-GPU machine (kind nvidia-h200-x2):
#   bash benchmark/nsa_offload/device_pair.sh 'JOB FOR GPU 0' 'JOB FOR GPU 1'
# A job is a shell command line, typically "[VAR=value ...] bash
# benchmark/nsa_offload/device_run.sh STEP...". Install first (wheels-b, patch)
# once, then each job gets its GPU, its own $OUT/gpuN and $PAIR_TIMEOUT
# seconds (default 570) so that the call ends before the device's limit.
# Results: $OUT/gpuN/results.tgz and $OUT/gpuN.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash benchmark/nsa_offload/device_run.sh || exit 1
rm -f "$OUT"/results.tgz
pids=()
for gpu in 0 1; do
  job=${1:-true}; shift || true
  mkdir -p "$OUT/gpu$gpu"
  OUT=$OUT/gpu$gpu CUDA_VISIBLE_DEVICES=$gpu timeout "${PAIR_TIMEOUT:-570}" \
    bash -c "$job" >"$OUT/gpu$gpu.log" 2>&1 &
  pids+=($!)
done
rc=0
for gpu in 0 1; do
  wait "${pids[$gpu]}" || { echo "gpu$gpu job failed: rc $?"; rc=1; }
done
# A job cut by the timeout leaves its servers and loose files behind.
pkill -f sglang.launch_server; pkill -f "sglang::"; sleep 2
for gpu in 0 1; do
  d=$OUT/gpu$gpu
  [ -f "$d/results.tgz" ] || [ -z "$(ls -A "$d")" ] \
    || (cd "$d" && tar czf /tmp/pair-results.tgz . && rm -rf ./* && mv /tmp/pair-results.tgz results.tgz)
  echo "===== gpu$gpu ====="; tail -n 70 "$OUT/gpu$gpu.log"
done
exit $rc

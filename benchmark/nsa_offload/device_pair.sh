#!/bin/bash
# device_run.sh jobs side by side, one per GPU on a 2-GPU machine (kind
# nvidia-h200-x2), or several on one GPU with PAIR_GPUS (e.g. "0 0 0"):
#   bash benchmark/nsa_offload/device_pair.sh 'JOB FOR GPU 0' 'JOB FOR GPU 1' ...
# A job is a shell command line, typically "[VAR=value ...] bash
# benchmark/nsa_offload/device_run.sh STEP...". Install first (wheels-b, patch)
# once, then job i gets GPU ${PAIR_GPUS[i]} (default: i), its own $OUT/gpuI and
# $PAIR_TIMEOUT seconds (default 570) so that the call ends before the
# device's limit. Results: $OUT/gpuI/results.tgz and $OUT/gpuI.log. Jobs on
# one GPU must start no servers (their ports follow the GPU), and they
# time-slice it: four pytest jobs of many small kernels ran >10x slower than
# one (results/units/per_unit_gpu_gate/ section 7).
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash benchmark/nsa_offload/device_run.sh || exit 1
rm -f "$OUT"/results.tgz
jobs_=("$@")
[ ${#jobs_[@]} -gt 0 ] || jobs_=(true true)
gpus=(${PAIR_GPUS:-$(seq -s ' ' 0 $((${#jobs_[@]} - 1)))})
pids=()
for i in "${!jobs_[@]}"; do
  mkdir -p "$OUT/gpu$i"
  OUT=$OUT/gpu$i CUDA_VISIBLE_DEVICES=${gpus[$i]:-$i} timeout "${PAIR_TIMEOUT:-570}" \
    bash -c "${jobs_[$i]}" >"$OUT/gpu$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!jobs_[@]}"; do
  wait "${pids[$i]}" || { echo "gpu$i job failed: rc $?"; rc=1; }
done
# A job cut by the timeout leaves its servers and loose files behind.
pkill -f sglang.launch_server; pkill -f "sglang::"; sleep 2
for i in "${!jobs_[@]}"; do
  d=$OUT/gpu$i
  [ -f "$d/results.tgz" ] || [ -z "$(ls -A "$d")" ] \
    || (cd "$d" && tar czf /tmp/pair-results.tgz . && rm -rf ./* && mv /tmp/pair-results.tgz results.tgz)
  echo "===== gpu$i ====="; tail -n 70 "$OUT/gpu$i.log"
done
exit $rc

#!/bin/bash
# Runs on the lent GPU host (see ../shared/DEVICE.md), sglang 0.5.17 from the
# wheelhouse .devwheels/wheels-0517-{a1,a2,b} (../shared/device/wheels-0517-{a,b}
# split by size: a1 flashinfer + sglang-kernel, a2 sglang + deep-gemm +
# transformers + tokenizers, b the rest). Calls back to back:
#   bash benchmark/nsa_offload/device_run.sh install-a   (carry .devwheels/wheels-0517-a1;
#     again with wheels-0517-a2; a third time with jitcache-extra where one is saved)
#   bash benchmark/nsa_offload/device_run.sh STEP...     (carry .devwheels/wheels-0517-b)
# STEP: checks (GPU correctness, no servers), engine (GPU checks + P1/P2
# benchmarks), units (LRU units: GPU tests,
# exactness with/without, a server with units), swap-units (the swap with
# units: its time, the kernels vs the torch reference), e2e (servers: exactness,
# capacity, idle; args in $E2E_ARGS), bench (server throughput/ITL vs no
# offload and HiSparse; $BENCH_TOPK model|override, $BENCH_ARGS), exact
# (exactness on a generated checkpoint; $EXACT_MODEL, $EXACT_ARGS), soak (the GPU
# soak; $SOAK_ARGS), gputest (test/srt/test_decode_nsa_kv_offload.py;
# $GPUTEST_ARGS), kernel-gate (after a kernel change: the swap kernels = the
# reference with units, the LRU CUDA tests and three tiny exactness servers),
# elastic-gate (the tiny servers of idle-loc units and of 2 units side by
# side), churn (the churn soaks in verify mode, plain and MTP), churn-mtp (the
# MTP one alone), churn-rank (the churn soak on the rank model), wait:NAME
# (until the soak writing $OUT/NAME has its pools), verify-gate
# (the verify-mode tiny gate beside the default's), default-gate (the default's
# tiny exactness servers: bf16, retraction, leveling, 7 x 4,416 rows), demo (scripts/demo.sh; $DEMO_ARGS), savejit
# (pack the JIT caches built here into $OUT/jitcache-extra/ for the next
# machine), pack (only the packing of $OUT that ends every call: after a
# "timeout" stopped one), a path to a python script, or "pytest FILES..." (the rest of the
# arguments; $PYTEST_TIMEOUT seconds, default 500).
# The device's copy of .git can be stale: prefix the step with CODE_COMMIT=<hash of
# the tree sent> so that the results name the code that ran (server_utils.git_commit).
# With soaks, also CALL_S=<the call's limit less ~20 s>: they finish within it.
# Results go under $OUT. A cold machine compiles JIT kernels for ~180 s at
# its first server start (sglang's prefill CUDA graph capture): end the
# first warm call with "savejit" and carry the returned jitcache-extra/
# folder as .devwheels/jitcache-extra/ afterwards.
#
# One-time setup in the checkout (the wheelhouse is too big for git):
#   mkdir -p .devwheels && cp -r ../shared/device/wheels-0517-* .devwheels/  (then split a)
#   echo /.devwheels/ >> .git/info/exclude
set -uo pipefail
W=.devwheels
# sglang 0.5.17 reads the DSA_ names only (its NSA_ threshold name is ignored
# and short prefills go to FA3, trimmed from the wheelhouse); DeepGEMM's
# start-up precompile held stock 0.5.17's /health at 503 for minutes.
export SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
# $CALL_S: the seconds this call may run (the run's limit, less the packing).
# The soak steps then end their soaks early enough to write their records
# within it (soak.py --wall-budget-s): at b456b99 a rank soak's 310 s cold
# start left its 220 s soak no time to finish, and a "timeout" around the
# call cut both soaks' writes (0 records came back).
CALL_END=$(( $(date +%s) + ${CALL_S:-100000} ))
# "--wall-budget-s N" for a soak starting now: the rest of the call, 15 s
# kept for packing $OUT.
wall_budget() { echo "--wall-budget-s $(( CALL_END - $(date +%s) - 15 ))"; }
# A step's "timeout" of $1 s, cut to the rest of the call less 5 s.
call_timeout() { local left=$(( CALL_END - $(date +%s) - 5 )); echo $(( $1 < left ? $1 : left )); }
# At most 8 files come back from $OUT: pack them (the JIT cache stays apart;
# a returned file is at most 16 MiB: it comes back in parts). Also when a
# "timeout" around this script stopped it: "timeout N device_run.sh STEP...;
# device_run.sh pack" (c227cb6: eight files of a soak came back, its summary
# did not); tar's 1 = a file changed while it read it.
pack_out() {
  # Packed already (the script's own end): nothing new to pack.
  [ -n "$(ls -A $OUT | grep -vx -e results.tgz -e jitcache-extra)" ] || return 0
  (cd $OUT && rm -rf /tmp/jit-keep && { [ ! -d jitcache-extra ] || mv jitcache-extra /tmp/jit-keep; } \
    && { tar czf /tmp/results.tgz --exclude=./results.tgz . || [ $? -eq 1 ]; } \
    && rm -rf ./* && mv /tmp/results.tgz . \
    && { [ ! -d /tmp/jit-keep ] || mv /tmp/jit-keep jitcache-extra; })
}
if [ "${1:-}" = pack ]; then pack_out; ls -la $OUT; exit 0; fi
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site"
if [ "${1:-}" = install-a ]; then
  # wheels-0517-a1 / wheels-0517-a2, one per call: the checkout plus both
  # exceed what one call carries (64 MiB).
  # A third call may carry .devwheels/jitcache-extra alone (19 MB at ae6c075:
  # it fits beside no wheel folder and the 29 MB tree).
  if ls $W/wheels-0517-a*/*.whl > /dev/null 2>&1; then
    $PIP $W/wheels-0517-a*/*.whl && echo "installed: $(ls $W | grep wheels-0517-a)" || exit 1
  elif [ ! -d $W/jitcache-extra ]; then
    echo "install-a: carry .devwheels/wheels-0517-a1, -a2 or jitcache-extra"; exit 1
  fi
  # A JIT cache carried here waits for the wheels-b call.
  if [ -d $W/jitcache-extra ]; then
    mkdir -p /tmp/jit-parts && cp $W/jitcache-extra/part-* /tmp/jit-parts/ \
      && echo "JIT cache kept: $(ls /tmp/jit-parts | wc -l) part(s)"
  fi
  exit 0
fi
# The ninja-built JIT caches (tvm-ffi, flashinfer) count as stale when their
# sources are newer: pip writes the wheels' sources now, tar restores the
# cached objects' old times: the tvm-ffi kernels of the carried caches, same
# hashed names, were built again on each fresh machine. They take the time of
# .jit-stamp (after pip, before .wheels-b): "savejit" packs only what is newer
# than .wheels-b, built here.
touch_jit() { find ~/.cache/tvm-ffi ~/.cache/flashinfer -type f -exec touch -r /tmp/site/.jit-stamp {} + 2>/dev/null; }
if [ ! -f /tmp/site/.wheels-b ]; then
  $PIP $W/wheels-0517-b/*.whl && touch /tmp/site/.jit-stamp || exit 1
  # JIT caches saved by an earlier "savejit" step (Triton MoE kernels etc.):
  # carry .devwheels/jitcache-extra (a folder of archive parts; older: one
  # jitcache-extra.tgz) to skip ~2 min of compiling per start.
  [ -f $W/jitcache-extra.tgz ] && tar xzf $W/jitcache-extra.tgz -C ~
  [ -d $W/jitcache-extra ] && cat $W/jitcache-extra/part-* | tar xzf - -C ~
  [ -d /tmp/jit-parts ] && cat /tmp/jit-parts/part-* | tar xzf - -C ~
  touch_jit; sleep 1; touch /tmp/site/.wheels-b
fi
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# torch.compile's cache under ~ too, so that "savejit" can carry it.
export TORCHINDUCTOR_CACHE_DIR=$HOME/.cache/torchinductor
# --with-bench-hooks: the top-k trace override / recorder the benchmarks use
# (traces/bench_hooks/<version>/series).
python3 scripts/apply_patch.py --sglang-dir /tmp/site --with-bench-hooks || exit 1
# Jobs started beside this one in the same call wait for this mark.
touch /tmp/site/.ready
# The tiny gates' reference (resumed, relative to server/): sglang 0.5.17's
# no-offload outputs and negative control on the tiny checkpoint.
TINY_REF=../results/exactness/tiny_0517_32751af/exactness.json
# Jobs side by side (device_pair.sh) need their own server ports.
GPU0=${CUDA_VISIBLE_DEVICES:-0}; GPU0=${GPU0%%,*}
rc=0
if [ "${1:-}" = pytest ]; then
  shift
  # The whole log comes back in $OUT/pytest.txt; the failures' messages here.
  timeout ${PYTEST_TIMEOUT:-500} python3 -m pytest -q -p no:cacheprovider -rfE "$@" \
    > $OUT/pytest.txt 2>&1 || rc=1
  grep -E "^(E   |FAILED|ERROR)|[0-9]+ (passed|failed)" $OUT/pytest.txt | tail -80
  set --
fi
# --mem-fraction-static for a KV budget of $1 GiB of the memory free now:
# sglang gives f * (GiB free at its start - 0.7) - 0.51 GiB (the tiny
# model's weights; 0.08 more with its MTP layer).
kv_fraction() {
  nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i $GPU0 \
    | awk -v kv=$1 '{printf "%.4f", (kv + 0.6) / ($1 / 1024 - 0.7)}'
}
# One step; "bg:STEP" runs it beside the following ones (its output in
# $OUT/STEP.log, shown at the end), e.g. "bg:soak exact".
run_step() {
  local step=$1
  case $step in
    engine)
      timeout 100 python3 benchmark/nsa_offload/engine/gpu_check_lru.py --out $OUT/gpu_check_lru.json 2>&1 | tail -40 || rc=1
      timeout 60 python3 benchmark/nsa_offload/engine/gpu_check_exact.py --out $OUT/exact 2>&1 | tail -30 || rc=1
      timeout 70 python3 benchmark/nsa_offload/engine/bench_copy.py --quick --out $OUT/copy 2>&1 | tail -40 || rc=1
      timeout 80 python3 benchmark/nsa_offload/engine/bench_swap.py --out $OUT/swap 2>&1 | tail -40 || rc=1
      ;;
    checks)
      # GPU correctness without servers or timing (fine beside other jobs):
      # the CUDA paths of the CPU tests, FlashMLA through the offloaded page
      # table, the single- and multi-token Triton swaps against the reference.
      timeout 400 python3 -m pytest -q -p no:cacheprovider test/srt/test_lru_cache_state.py \
        test/srt/test_sparse_cache_controller.py test/srt/test_nsa_kv_offload_integration.py \
        test/srt/test_nsa_kv_offload_multi_token.py test/srt/test_nsa_kv_offload_verify_exactness.py \
        2>&1 | tail -25 > $OUT/pytest_cuda.txt; cat $OUT/pytest_cuda.txt
      grep -q " passed" $OUT/pytest_cuda.txt && ! grep -qE " (failed|errors?)\b" $OUT/pytest_cuda.txt || rc=1
      timeout 90 python3 benchmark/nsa_offload/engine/gpu_check_exact.py --out $OUT/gpu_check_exact 2>&1 | tail -6 || rc=1
      timeout 200 python3 benchmark/nsa_offload/engine/gpu_check_lru.py --out $OUT/gpu_check_lru.json 2>&1 | tail -12 || rc=1
      timeout 150 python3 benchmark/nsa_offload/engine/gpu_check_lru_multi.py --out $OUT/gpu_check_lru_multi.json 2>&1 | tail -12 || rc=1
      ;;
    units)
      # Units (docs/ELASTIC_BUFFER.md): CUDA paths of the CPU tests, the
      # exactness check with and without units, a server run with units
      # (outputs vs no offload).
      timeout 240 python3 -m pytest -q -p no:cacheprovider test/srt/test_lru_cache_state.py \
        test/srt/test_sparse_cache_controller.py test/srt/test_nsa_kv_offload_integration.py 2>&1 | tail -15 || rc=1
      timeout 60 python3 benchmark/nsa_offload/engine/gpu_check_exact.py --out $OUT/exact 2>&1 | tail -4 || rc=1
      timeout 60 python3 benchmark/nsa_offload/engine/gpu_check_exact.py --out $OUT/exact_units \
        --max-units 3 --extra-regions 2 2>&1 | tail -4 || rc=1
      (cd benchmark/nsa_offload/server && timeout ${E2E_TIMEOUT:-300} python3 e2e_server.py --out $OUT/e2e_units \
        --port $((31000 + 100 * GPU0)) --max-units 4 ${E2E_ARGS:-}) 2>&1 | tail -30 || rc=1
      ;;
    swap-units)
      # The LRU swap with units: its time, the kernels vs the torch reference.
      timeout 240 python3 benchmark/nsa_offload/engine/bench_swap_units.py --out $OUT/swap_units 2>&1 | tail -20 || rc=1
      ;;
    exact)
      # End-to-end exactness on a generated checkpoint (exactness.py):
      # $EXACT_MODEL tiny|rank, more flags in $EXACT_ARGS; a second run side
      # by side (its own ports and output) with $EXACT_ARGS_2 ($EXACT_MODEL_2, default
      # $EXACT_MODEL), a third with $EXACT_ARGS_3 (tiny servers: e.g. another
      # --resume-from).
      side_pids=()
      for k in 2 3; do
        side_args=EXACT_ARGS_$k side_model=EXACT_MODEL_$k
        [ -n "${!side_args:-}" ] || continue
        m=${!side_model:-${EXACT_MODEL:-tiny}}
        (cd benchmark/nsa_offload/server && timeout ${EXACT_TIMEOUT:-560} python3 exactness.py \
          --out $OUT/exact_${m}_$k --model $m --port $((32000 + 1000 * (k - 1) + 100 * GPU0)) \
          ${!side_args} > /tmp/exact_$k.log 2>&1) &
        side_pids+=("$k:$!")
      done
      (cd benchmark/nsa_offload/server && timeout ${EXACT_TIMEOUT:-560} python3 exactness.py \
        --out $OUT/exact_${EXACT_MODEL:-tiny} --model ${EXACT_MODEL:-tiny} --port $((32000 + 100 * GPU0)) \
        ${EXACT_ARGS:-}) 2>&1 | tail -60 || rc=1
      for kp in "${side_pids[@]}"; do
        # Only these runs: a bare "wait" would also reap the bg: steps.
        wait ${kp#*:} || rc=1; echo "=== side run ${kp%%:*}"; tail -40 /tmp/exact_${kp%%:*}.log
      done
      # Kept for a later call on this (warm) machine: EXACT_ARGS="--resume-from
      # /tmp/exact_keep/exact_rank/exactness.json --servers ..." runs more servers
      # against the same outputs.
      mkdir -p /tmp/exact_keep && cp -r $OUT/exact_${EXACT_MODEL:-tiny}* /tmp/exact_keep/
      ;;
    faults)
      # The two GPU faults' cause (gpu_fault_repro.py: the rank kernel with and
      # without its barrier at 4/8/16 warps, 3 repeats), compute-sanitizer
      # synccheck and memcheck over a small repro, then the failing
      # configurations' tests on CUDA three times: 2 units + warm units +
      # direct slots through the coordinator at the served sizes, and the
      # verify mode (a planted wrong row counted).
      timeout 240 python3 benchmark/nsa_offload/engine/gpu_fault_repro.py \
        --out $OUT/fault_repro.json 2>&1 | tail -3 || rc=1
      # compute-sanitizer refuses gVisor (the H200s): FAULTS_SANITIZERS="".
      for tool in ${FAULTS_SANITIZERS-synccheck memcheck}; do
        timeout 120 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 \
          python3 benchmark/nsa_offload/engine/gpu_fault_repro.py --out $OUT/sanitizer_$tool.json \
          --small --trials 2 --steps 3 --repeats 1 > $OUT/sanitizer_$tool.txt 2>&1
        echo "compute-sanitizer $tool: rc=$?"; grep -E "ERROR SUMMARY" $OUT/sanitizer_$tool.txt
      done
      for i in 1 2 3; do
        # --durations: at c227cb6 two of three runs were still in the 2-unit
        # shadowed test at 55 s, the third took 36 s in all.
        timeout 150 python3 -m pytest -q -p no:cacheprovider --durations=4 \
          test/srt/test_nsa_kv_offload_verify_mode.py \
          test/srt/test_nsa_kv_offload_integration.py::TestOneRequestAtATime > $OUT/pytest_faults_$i.txt 2>&1 || rc=1
        echo "run $i: $(tail -1 $OUT/pytest_faults_$i.txt)"
      done
      ;;
    churn)
      # The churn soak on the defaults in verify mode (soak.py: random
      # arrivals, prompts 1-30K skewed short, client aborts, forced
      # retraction), with a small GPU KV budget (1.25 GiB) that the locs
      # mostly take (a large --max-total-tokens): few spare regions, units
      # lent by idle locs and staging, taken back and moved; then the MTP
      # run ("churn-mtp") beside it once this server's pools are allocated.
      # The batch-1 gate against no offload is the step "verify-gate".
      # 400,000 locs (soak/churn_400k_6dc68ef/, 1.5 GiB) filled the host
      # pool to 81% only; 300,000 at 1.25 GiB filled it (99% logged, soak/).
      SOAK_ARGS="${SOAK_ARGS:---num-requests 4000 --concurrency 64 --max-len 30000 \
        --max-total-tokens 300000 --retract-interval 40 --probe-tokens 16 \
        --time-budget-s 150} --mem-fraction-static $(kv_fraction 1.25)" \
        run_step soak > $OUT/soak_step.log 2>&1 &
      local soak_pid=$!
      run_step wait:soak
      run_step churn-mtp || rc=1
      wait $soak_pid || rc=1
      echo "=== soak"; tail -32 $OUT/soak_step.log
      ;;
    churn-mtp)
      # The churn soak with MTP (spec v2, 3 steps) at a 1.2 GiB KV budget
      # of the memory free now, locs bound by it (~175,000 by the offload's
      # sizing, 0 spare regions): 400,000 locs at 1.5 GiB (277,440 held)
      # filled the host pool to 62% only (soak/mtp/), a 200,000 cap at 1.5
      # GiB left bytes for spare regions and no unit was scarce (mtp_200k/).
      # At c613ab4 1-128 new tokens left it prefill-bound, 68% full at most
      # (mtp_c613ab4/): up to 512 new tokens keep requests resident longer.
      # The soak's own --wall-budget-s ends it within the call: at ae6c075 a
      # 400 s "timeout" here killed it (and its server) at 406 s, 250 s of
      # them a cold start (mtp_ae6c075_cut/).
      (cd benchmark/nsa_offload/server && timeout $(call_timeout ${MTP_SOAK_TIMEOUT:-570}) python3 soak.py \
        --out $OUT/soak_mtp --port $((34050 + 100 * GPU0)) --mtp 3 \
        --mem-fraction-static $(kv_fraction 1.2) $(wall_budget) \
        ${MTP_SOAK_ARGS:---num-requests 2000 --concurrency 32 --max-len 30000 \
        --max-total-tokens 400000 --max-new-tokens 512 --retract-interval 40 \
        --probe-tokens 16 --time-budget-s 300}) > $OUT/soak_mtp_step.log 2>&1 || rc=1
      echo "=== MTP soak"; tail -32 $OUT/soak_mtp_step.log
      ;;
    wait:*)
      # Until the soak writing to $OUT/<name> has its pools (soak_started),
      # at most 400 s: servers started beside it then size their pools
      # from what it left (sglang sizes them from the memory free at its
      # start; two sizing at once take each other's).
      local t=0
      while [ ! -f $OUT/${step#wait:}/soak_started ] && [ $t -lt 400 ]; do
        sleep 2; t=$((t + 2))
      done
      echo "${step#wait:} started after ${t} s"
      ;;
    churn-rank)
      # The churn soak of "churn" on the rank model (61 layers, dummy weights:
      # the verify mode is its oracle), one server, 32 clients. In verify mode
      # every loc also keeps sglang's full KV row per layer (40 KB a loc on
      # 61 layers, beside the offload's 8 KB): at c227cb6 a 12 GiB budget
      # held 69,440 locs. At b456b99 24 GiB with a 6 GB host pool held
      # 160,960 locs (the host cap) and left 50 spare regions: 32 clients
      # filled 83% of it and no unit was moved or reclaimed
      # (soak/rank_b456b99/). 14.5 GiB and an 8 GB pool: ~120,000 locs
      # bound by the GPU bytes, 0 spare regions (the offload's sizing). The
      # rank model admits ~1.2 requests/s: a floor of 200. A cold machine
      # takes ~310 s to its first soak request (JIT compiles, 15 probes),
      # a warm one ~160 s; sglang's prefill CUDA graphs off (~35 s less).
      # Output in $OUT/soak_rank/ ("wait:soak_rank").
      (cd benchmark/nsa_offload/server && timeout $(call_timeout ${SOAK_TIMEOUT:-570}) python3 soak.py \
        --out $OUT/soak_rank --port $((34000 + 100 * GPU0)) $(wall_budget) ${SOAK_ARGS:---model rank \
        --num-requests 3000 --concurrency 32 --max-len 30000 --max-total-tokens 600000 \
        --host-pool-gb 8 --kv-budget-gib 14.5 --min-requests 200 --retract-interval 40 --probe-tokens 8 \
        --time-budget-s 220 --extra-server-args=--disable-prefill-cuda-graph}) 2>&1 | tail -40 || rc=1
      ;;
    verify-gate)
      # The default in verify mode on the tiny checkpoint at batch 1 against
      # the no-offload outputs of $TINY_REF and negative control, beside the
      # default without verify (the gate of the lean default path); then the
      # verify mode's CUDA tests (a planted wrong row counted, the check in
      # a CUDA graph, mode fail's poll) and the suite's --full tier.
      local resume="--resume-from $TINY_REF --parallel 1"
      EXACT_MODEL=tiny EXACT_ARGS="--servers ours_fp8_verify $resume" \
        EXACT_ARGS_2="--servers ours_fp8 $resume" run_step exact
      timeout 150 python3 -m pytest -q -p no:cacheprovider test/srt/test_nsa_kv_offload_verify_mode.py \
        > $OUT/pytest_verify_cuda.txt 2>&1 || rc=1
      echo "verify-mode tests on CUDA: $(tail -1 $OUT/pytest_verify_cuda.txt)"
      # The CPU suite's slow tier (test/README.md: the GPU gate runs it); the
      # stream-order checker simulates streams on CPU only: CUDA hidden.
      timeout 150 python3 -m pytest -q -p no:cacheprovider --full test/tools/test_kernel_resources.py \
        > $OUT/pytest_full_tier.txt 2>&1 || rc=1
      CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 150 python3 -m pytest -q -p no:cacheprovider \
        --full test/checkers/test_stream_order.py::TestLifecycleStreams::test_colocated \
        > $OUT/pytest_full_tier_cpu.txt 2>&1 || rc=1
      echo "full tier: $(tail -1 $OUT/pytest_full_tier.txt); on CPU: $(tail -1 $OUT/pytest_full_tier_cpu.txt)"
      ;;
    kernel-gate)
      # After any change to the swap, reorder or copy kernels, before timing
      # it: the swap kernels against the torch reference at the served sizes
      # (4096 slots, top-k 2048, 32K contexts, beside the rest), the LRU
      # state's CUDA tests, then the tiny checkpoint end to end (the default;
      # one unit, the fixed buffer; 2 units, walks beside direct requests,
      # whose flat-copy twin read wrong KV at e20c81a, 44/64; resumed from
      # the no-offload outputs of $TINY_REF). The CPU interpreter and the kernel tests passed a
      # rewrite that the end-to-end run caught (results/exactness/tiny_reorder_regression/).
      local resume="--resume-from $TINY_REF --parallel 1"
      (timeout 240 python3 benchmark/nsa_offload/engine/bench_swap_units.py --out $OUT/gate_swap_units \
        --batch-sizes 1,8,32 --units 2,4 --repeats 3 > $OUT/gate_swap_units.log 2>&1) &
      local swap_units=$!
      GPUTEST_ARGS="test/srt/test_lru_cache_state.py::TestTritonMatchesReference \
        test/srt/test_lru_cache_state.py::TestDirectSlots test/srt/test_lru_cache_state.py::TestCudaGraph \
        test/srt/test_lru_cache_state.py::TestUnits test/srt/test_nsa_kv_offload_multi_token.py" \
        GPUTEST_TIMEOUT=200 run_step gputest
      EXACT_MODEL=tiny EXACT_ARGS="--servers ours_fp8 $resume" \
        EXACT_ARGS_2="--servers ours_fp8_1unit $resume" \
        EXACT_ARGS_3="--servers ours_fp8_2units $resume" run_step exact
      wait $swap_units || rc=1
      echo "=== swap kernels vs reference"; tail -12 $OUT/gate_swap_units.log
      ;;
    units-check)
      # The split swap against the torch reference at the served sizes
      # (gpu_check_units.py: full warm-ups as warm units do, then cold
      # units), then the CUDA paths of the unit and warm-unit tests through
      # the coordinator.
      # $UNITS_CHECK_ARGS: more flags; $UNITS_CHECK_WARPS: a run per
      # --num-warps value (default: the kernels' own); $UNITS_CHECK_WARM: the
      # warm-ups (default "full none"; "direct": direct mode).
      for warm in ${UNITS_CHECK_WARM:-full none}; do
        for w in ${UNITS_CHECK_WARPS:-0}; do
          local warps=""; [ "$w" = 0 ] || warps="--num-warps $w"
          timeout 200 python3 benchmark/nsa_offload/engine/gpu_check_units.py \
            --out $OUT/units_check_${warm}_$w.json --warm $warm $warps \
            ${UNITS_CHECK_ARGS:-} 2>&1 | grep -v Warning | tail -12 || rc=1
        done
      done
      [ -n "${UNITS_CHECK_ONLY:-}" ] && return $rc
      timeout 300 python3 -m pytest -q -p no:cacheprovider \
        test/srt/test_nsa_kv_offload_integration.py::TestPDDecodeWarmUnits \
        test/srt/test_nsa_kv_offload_integration.py::TestPDDecodeLeveling \
        test/srt/test_sparse_cache_controller.py::TestUnits 2>&1 | tail -15 || rc=1
      ;;
    elastic-gate)
      # The elastic defaults' gate (the default since 834aede), in one call:
      # the idle-loc units (ours_fp8_idle_locs, 2 request slots) and 2 units
      # (walks beside direct requests; its flat-copy twin read wrong KV,
      # 44/64 at e20c81a, results/units/per_unit_gpu_gate/), on the tiny
      # checkpoint side by side (servers, not pytest processes: those
      # time-slice the GPU), resumed from the no-offload outputs of $TINY_REF. A
      # fault seen in two of three runs needs repeats: call it again.
      local resume="--resume-from $TINY_REF --parallel 1"
      EXACT_MODEL=tiny EXACT_ARGS="--servers ours_fp8_idle_locs $resume" \
        EXACT_ARGS_2="--servers ours_fp8_2units $resume" run_step exact
      ;;
    default-gate)
      # The default (the elastic defaults since 834aede: warm units, direct
      # slots, spare regions, idle-loc units) on the tiny checkpoint with bf16, fp8 and
      # bf16 retraction, unit leveling, and the bench's 7 units of 4,416 rows;
      # three runs side by side, resumed from the no-offload outputs of $TINY_REF
      # (kernel-gate runs the fp8 default).
      local resume="--resume-from $TINY_REF --parallel 1"
      # $TINY_REF has the fp8 no-offload server only: each run starts the
      # bf16 and retracting no-offload servers it compares with.
      EXACT_MODEL=tiny EXACT_ARGS="--servers base_bf16,ours_bf16,ours_bf16_level $resume" \
        EXACT_ARGS_2="--servers base_bf16,base_bf16_retract,ours_bf16_retract $resume" \
        EXACT_ARGS_3="--servers base_fp8_retract,ours_fp8_retract,ours_fp8_tuned_4416 $resume" \
        run_step exact
      ;;
    soak)
      # The GPU soak (issue 21): soak.py, more flags in $SOAK_ARGS.
      (cd benchmark/nsa_offload/server && timeout $(call_timeout ${SOAK_TIMEOUT:-570}) python3 soak.py \
        --out $OUT/soak --port $((34000 + 100 * GPU0)) $(wall_budget) ${SOAK_ARGS:-}) 2>&1 | tail -40 || rc=1
      ;;
    e2e)
      (cd benchmark/nsa_offload/server && timeout ${E2E_TIMEOUT:-300} python3 e2e_server.py --out $OUT/e2e --port $((31000 + 100 * GPU0)) ${E2E_ARGS:-}) 2>&1 | tail -60 || rc=1
      ;;
    bench)
      # $BENCH_ARGS as the shell reads it: quotes keep a flag's spaces, e.g.
      # --extra-server-args='--disable-prefill-cuda-graph --context-length 131392'.
      eval "bench_args=(${BENCH_ARGS:-})"
      timeout ${BENCH_TIMEOUT:-570} python3 benchmark/nsa_offload/server/bench_server.py --quick --topk ${BENCH_TOPK:-model} --out $OUT/bench_${BENCH_TOPK:-model} --port $((31200 + 100 * GPU0)) "${bench_args[@]}" 2>&1 | tail -80 || rc=1
      # Raw profiler traces (--profile-steps) travel in their own file.
      for d in $OUT/bench_*/profiles; do
        [ -d "$d" ] && tar czf /tmp/profiles.tgz -C "$d" . && rm -rf "$d"
      done
      ;;
    gputest)
      # The upstream-style GPU test; $GPUTEST_ARGS: pytest node ids (default:
      # the whole file, more than one call's time: name a class per call).
      timeout ${GPUTEST_TIMEOUT:-560} python3 -m pytest -v -s -p no:cacheprovider \
        ${GPUTEST_ARGS:-test/srt/test_decode_nsa_kv_offload.py} > $OUT/gputest_pytest.txt 2>&1
      grep -E "PASSED|FAILED|ERROR|SKIPPED|negative control|passed|failed" $OUT/gputest_pytest.txt | tail -40
      grep -qE "[0-9]+ passed" $OUT/gputest_pytest.txt \
        && ! grep -qE "[0-9]+ (failed|errors?)" $OUT/gputest_pytest.txt || rc=1
      ;;
    demo)
      # The README's main command ($DEMO_ARGS, e.g. --quick).
      timeout ${DEMO_TIMEOUT:-560} bash scripts/demo.sh --out-dir $OUT/demo ${DEMO_ARGS:-} \
        > $OUT/demo_stdout.txt 2>&1 || rc=1
      tail -60 $OUT/demo_stdout.txt
      ;;
    savejit)
      # Triton's cache plus what the other JIT caches (deep_gemm, tvm-ffi,
      # flashinfer, torch.compile) built here: a cold server spends ~3 min
      # compiling in its prefill CUDA graph capture.
      # Copy the returned folder into .devwheels/ here.
      (cd ~ && { find .cache/deep_gemm .cache/tvm-ffi .cache/flashinfer \
        .cache/torchinductor -type f \
        -newer /tmp/site/.wheels-b 2>/dev/null; echo .triton; } \
        | tar czf /tmp/jitcache-extra.tgz -T -) && mkdir -p $OUT/jitcache-extra \
        && split -b 15000000 -d /tmp/jitcache-extra.tgz $OUT/jitcache-extra/part- \
        && rm /tmp/jitcache-extra.tgz && ls -la $OUT/jitcache-extra
      ;;
    *) timeout 500 python3 "$step" 2>&1 | tail -60 || rc=1 ;;
  esac
  return $rc
}
bg_steps=()
for step in "$@"; do
  if [ "${step#bg:}" != "$step" ]; then
    step=${step#bg:}; run_step $step > $OUT/$step.log 2>&1 &
    bg_steps+=("$!:$step")
  else
    run_step $step
  fi
done
for job in "${bg_steps[@]}"; do
  wait ${job%%:*} || rc=1
  echo "=== bg ${job#*:}"; tail -40 $OUT/${job#*:}.log
done
pack_out
# A returned file is at most 16 MiB: larger traces stay behind (summaries are kept).
if [ -f /tmp/profiles.tgz ]; then
  if [ "$(stat -c %s /tmp/profiles.tgz)" -lt 15000000 ]; then mv /tmp/profiles.tgz $OUT/
  else echo "profiles.tgz too large to return: $(du -h /tmp/profiles.tgz)"; fi
fi
exit $rc

#!/usr/bin/env bash
# Run the CPU test suite against the patched sglang installed in the venv.
#
#   bash scripts/test.sh [pytest args...]     # VENV=... overrides .venv
#   bash scripts/test.sh test/srt/test_cpu_env.py -x   # some tests only
#   TEST_WORKERS=1 bash scripts/test.sh                 # the suite in one process
#   SGLANG_VERSION=0.5.23 bash scripts/test.sh          # on sglang 0.5.23 (.venv-0.5.23)
#
# 1. scripts/setup_cpu_env.sh builds or tops up the venv of SGLANG_VERSION
#    (default 0.5.17; fast when nothing changed) and 2. re-applies our
#    modules and patches/<version>/ into its sglang, so edits under
#    python/sglang/ and patches/ are always what gets tested.
#
# Without SGLANG_VERSION (and VENV) the suite runs on every supported release
# in turn, what CI runs: 0.5.17, then 0.5.23 (its venv overlays .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${SGLANG_VERSION:-}" && -z "${VENV:-}" ]]; then
    rc=0
    for version in 0.5.17 0.5.23; do
        echo "[test.sh] sglang $version"
        SGLANG_VERSION=$version bash "${BASH_SOURCE[0]}" "$@" || rc=1
    done
    exit $rc
fi
export SGLANG_VERSION="${SGLANG_VERSION:-0.5.17}"
if [[ -z "${VENV:-}" ]]; then
    # As scripts/setup_cpu_env.sh: .venv for the default, else .venv-<version>.
    VENV="$ROOT/.venv"
    [[ "$SGLANG_VERSION" == 0.5.17 ]] || VENV="$ROOT/.venv-$SGLANG_VERSION"
fi
export VENV

bash "$ROOT/scripts/setup_cpu_env.sh"

cd "$ROOT"
# The tests must import the sglang installed (and patched) in the venv, never
# the files under python/ of this repo.
unset PYTHONPATH

# The whole suite unless the arguments name tests (paths or node ids). On a
# release other than 0.5.17, what does not depend on the release has
# run on the first and is left out: the benchmark tools' tests but those that
# read the release's names (the top-k trace hook, server flags), and the LRU
# state's and its kernels' tests (our modules and torch only).
targets=(test)
if [[ "$SGLANG_VERSION" != 0.5.17 ]]; then
    targets=(test/srt test/checkers test/tools/test_topk_trace.py test/tools/test_capacity_report.py
        --ignore=test/srt/test_lru_cache_state.py --ignore=test/checkers/test_kernel_hazards.py)
fi
if [[ "$SGLANG_VERSION" == 0.5.23 ]]; then
    # Also the controller's and the multi-token swap's own tests (our modules;
    # the integration tests run them through 0.5.23's pools).
    targets+=(--ignore=test/srt/test_sparse_cache_controller.py
        --ignore=test/srt/test_nsa_kv_offload_multi_token.py)
fi
for arg in "$@"; do
    if [[ "$arg" == test/* || ("$arg" != -* && -e "$arg") ]]; then
        targets=()
        break
    fi
done

# The whole suite runs on every CPU core (pytest-xdist; an idle worker steals tests
# from a busy one; TEST_WORKERS=N picks the number of workers, TEST_WORKERS=1 runs
# one process). One torch thread per worker: the workers fill the cores.
workers=()
if [[ ${#targets[@]} -gt 0 && "${TEST_WORKERS:-auto}" != 1 ]]; then
    workers=(-n "${TEST_WORKERS:-auto}" --dist worksteal)
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

set +e
"$VENV/bin/python" -m pytest "${targets[@]}" "${workers[@]}" -q "$@"
rc=$?
set -e
if [[ $rc -eq 5 && $# -gt 0 ]]; then
    # pytest's "no tests collected": fine for a filter that matches nothing
    # (e.g. -k), a failure for the full suite (CI passes no arguments).
    echo "[test.sh] no tests matched: $*"
    exit 0
fi
exit $rc

#!/usr/bin/env bash
# The main job: sets up the CPU venv (as the tests do), then pictures what the
# offload gains (requests per GPU, from the product's pool sizing) and what it
# costs (decode ITL over no offload, from the committed GPU measurements).
#
#   bash scripts/demo.sh [--out-dir DIR] [--colocated] [--kv-budget-gib G] [--host-pool-gb G]
#   bash scripts/demo.sh --help
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VENV="${VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup_cpu_env.sh"
unset PYTHONPATH
exec "$VENV/bin/python" "$ROOT/benchmark/nsa_offload/demo.py" "$@"

#!/usr/bin/env bash
# The main job. On a GPU host where sglang 0.5.12.post1 (+ sgl-kernel) is
# installed and patched (python scripts/apply_patch.py --sglang-dir ...), it
# runs real servers without and with --enable-decode-nsa-kv-offload and
# prints exactness (a generated tiny checkpoint, one request at a time,
# deterministic top-k, the negative control where the benchmark hooks are
# installed), capacity and idle checks. Anywhere else it builds the CPU
# venv (as the tests do) and replays the embedded DeepSeek-V3.2 top-k trace
# through our policy and HiSparse's, with the reference engine's exactness.
#
#   bash scripts/demo.sh [--quick] [--out-dir DIR] [--mode cpu|gpu]
#   bash scripts/demo.sh --help      # what it shows and what counts as good
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# --help (and bad arguments) answer at once, before any venv is built: demo.py
# needs only the standard library to parse its arguments.
for arg in "$@"; do
    case "$arg" in
    -h | --help) exec python3 "$ROOT/benchmark/nsa_offload/demo.py" --help ;;
    esac
done
python3 "$ROOT/benchmark/nsa_offload/demo.py" --check-args "$@" || exit 2
if python3 -c "import torch, sgl_kernel, sglang; assert torch.cuda.is_available()" 2>/dev/null; then
    exec python3 "$ROOT/benchmark/nsa_offload/demo.py" "$@"
fi
export VENV="${VENV:-$ROOT/.venv}"
bash "$ROOT/scripts/setup_cpu_env.sh"
unset PYTHONPATH
export TRITON_INTERPRET=1
exec "$VENV/bin/python" "$ROOT/benchmark/nsa_offload/demo.py" --mode cpu "$@"

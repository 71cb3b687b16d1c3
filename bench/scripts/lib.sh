# Shared helpers for the bench scripts: start a server on 127.0.0.1, wait until it is
# ready, stop it. Sourced, not executed.

CACHE="${SLIPWAY_CACHE:-$HOME/.cache/slipway}"
MODEL="${MODEL:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-2}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$CACHE/target}"
SERVER_PID=""

log() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

# Benchmarks on a shared machine are only as good as its idle CPU: say how busy it is.
note_load() {
    local load cores
    load="$(cut -d' ' -f1 /proc/loadavg)"
    cores="$(nproc)"
    log "load average $load on $cores cores${1:+ ($1)}"
    if python3 -c "import sys; sys.exit(0 if float('$load') > $cores else 1)"; then
        log "WARNING: the machine is busy (load > cores); latencies include CPU contention"
    fi
}

ensure_model() {
    if [[ ! -f "$MODEL" ]]; then
        if [[ -x engine/scripts/fetch-model ]]; then
            log "model missing; fetching it with engine/scripts/fetch-model"
            engine/scripts/fetch-model >&2
        fi
    fi
    [[ -f "$MODEL" ]] || { log "model not found: $MODEL (run 'make model')"; return 1; }
}

# Builds slipway-bench and sets BENCH to its path (a BENCH already set to an
# executable is used as is).
build_bench() {
    if [[ -n "${BENCH:-}" && -x "$BENCH" ]]; then
        log "using slipway-bench at $BENCH"
        return 0
    fi
    local profile="${BENCH_PROFILE:-release}"
    log "building slipway-bench ($profile)"
    nice cargo build --profile "$profile" -p slipway-bench >&2
    local dir="$profile"
    [[ "$profile" == dev ]] && dir=debug
    BENCH="$CARGO_TARGET_DIR/$dir/slipway-bench"
}

# wait_ready URL SECONDS: polls URL/health until it answers 200.
wait_ready() {
    local url="$1" limit="$2" i
    for ((i = 0; i < limit * 2; i++)); do
        if [[ -n "$SERVER_PID" ]] && ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "server exited before becoming ready"
            return 1
        fi
        if curl -sf -o /dev/null "$url/health"; then
            return 0
        fi
        sleep 0.5
    done
    log "server not ready after ${limit}s"
    return 1
}

# start_server LOGFILE CMD...: starts CMD in the background, remembers its pid.
start_server() {
    local logfile="$1"
    shift
    log "starting: $*"
    "$@" >"$logfile" 2>&1 &
    SERVER_PID=$!
}

stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 20); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

# start_llama NP PORT LOGFILE: llama-server with NP parallel slots (continuous batching).
# LLAMA_POLL: its busy-wait level (0-100, llama.cpp's default 50); on a shared machine
# spinning threads lose their time slices, so bench-serving measures which is better.
start_llama() {
    local np="$1" port="$2" logfile="$3"
    # Each slot gets room for the largest prompt plus output (512 + 128) with margin.
    local ctx=$((np * ${CTX_PER_SLOT:-1024}))
    note_load "before llama-server -np $np --poll ${LLAMA_POLL:-50}"
    start_server "$logfile" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$port" \
        -t "$THREADS" -tb "$THREADS" -np "$np" -c "$ctx" -cb --poll "${LLAMA_POLL:-50}"
    wait_ready "http://127.0.0.1:$port" 120
}

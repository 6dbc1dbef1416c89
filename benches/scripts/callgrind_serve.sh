# Sourced by tracing_instructions.sh and auth_instructions.sh: what one `kvroute serve`
# config costs per request, in instructions. The proxy runs under valgrind's callgrind
# while proxy_bench sends it plain requests for a fixed time; the total instruction count
# is divided by the requests served (read from its /metrics). Instruction counts do not
# depend on what else the machine runs, unlike CPU seconds; start-up costs about 2M
# instructions, under 1% of a run.
#
# callgrind_prepare checks for valgrind, builds the release kvroute and proxy_bench, and
# sets `dir` to a scratch directory removed (with any proxy left running) on exit.
callgrind_prepare() {
    command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }
    cargo build --release --quiet --bin kvroute
    cargo build --release --quiet -p kvroute-proxy --example proxy_bench
    dir=$(mktemp -d)
    trap 'pkill -f "callgrind.*$dir" 2>/dev/null || true; rm -rf "$dir"' EXIT
}

# serve_instructions DIR NAME CONFIG UPSTREAM_PORT LISTEN_PORT RUN_MS [proxy_bench flags...]
# prints "INSTRUCTIONS REQUESTS". Needs the release kvroute and proxy_bench built.
serve_instructions() {
    local dir=$1 name=$2 cfg=$3 ups=$4 port=$5 run_ms=$6
    shift 6
    RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$dir/$name.out" \
        target/release/kvroute serve --config "$cfg" 2>"$dir/$name.log" &
    local pid=$!
    for _ in $(seq 1 120); do grep -q "serving" "$dir/$name.log" && break; sleep 0.5; done
    target/release/examples/proxy_bench "$run_ms" plain --no-inproc --upstream-port "$ups" --conc 4 --repeats 1 \
        --external "kvroute=127.0.0.1:$port@$pid" "$@" >/dev/null 2>&1
    local requests
    requests=$(curl -s "127.0.0.1:$port/metrics" | awk '/^kvroute_requests_total/ {s += $2} END {print s + 0}')
    sleep 1.5 # a last export, for tracing
    kill -INT "$pid"
    wait "$pid" || true
    local ir
    ir=$(callgrind_annotate "$dir/$name.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    if [ -z "$ir" ] || [ "$requests" = 0 ]; then
        echo "$name: no requests were served; see $dir/$name.log" >&2
        return 1
    fi
    echo "$ir $requests"
}

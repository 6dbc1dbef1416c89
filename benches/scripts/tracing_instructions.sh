#!/usr/bin/env bash
# What tracing costs the proxy per request, in instructions: `kvroute serve` runs under
# valgrind's callgrind while proxy_bench sends it plain requests for a fixed time, once
# per setting (tracing off, then at each sampling ratio), and the total instruction count
# is divided by the requests served (read from its /metrics). Instruction counts do not
# depend on what else the machine runs, unlike CPU seconds; start-up costs about 2M
# instructions, under 1% of a run.
#
# usage: benches/scripts/tracing_instructions.sh [ratios] [run_ms]
# (defaults "0 0.1 1.0", 6000 ms at concurrency 4). Needs valgrind. Builds the release
# binaries first. Prints one JSON line per setting, with the ratio to tracing off.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/scripts/traced_serve_config.sh
ratios=${1:-0 0.1 1.0}
run_ms=${2:-6000}
ups=19401
sink=19405
port=19412
command -v valgrind >/dev/null || { echo "valgrind is not installed (apt-get install valgrind)" >&2; exit 1; }

cargo build --release --quiet --bin kvroute
cargo build --release --quiet -p kvroute-proxy --example proxy_bench
dir=$(mktemp -d)
trap 'pkill -f "callgrind.*$dir" 2>/dev/null || true; rm -rf "$dir"' EXIT

# Instructions per request of one setting: `off` or a sampling ratio.
measure() {
    local cfg="$dir/$1.toml"
    traced_serve_config "$cfg" "$port" "$ups" "$1" "$sink"
    RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$dir/$1.out" \
        target/release/kvroute serve --config "$cfg" 2>"$dir/$1.log" &
    local pid=$!
    for _ in $(seq 1 120); do grep -q "serving" "$dir/$1.log" && break; sleep 0.5; done
    target/release/examples/proxy_bench "$run_ms" plain --no-inproc --upstream-port "$ups" --conc 4 --repeats 1 \
        --otlp-sink-port "$sink" --external "kvroute=127.0.0.1:$port@$pid" >/dev/null 2>&1
    local requests
    requests=$(curl -s "127.0.0.1:$port/metrics" | awk '/^kvroute_requests_total/ {s += $2} END {print s + 0}')
    sleep 1.5 # the last export
    kill -INT "$pid"
    wait "$pid" || true
    local ir
    ir=$(callgrind_annotate "$dir/$1.out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    echo "$ir $requests"
}

read -r ir n < <(measure off)
base=$((ir / n))
echo "{\"tracing\":\"off\",\"requests\":$n,\"instructions_per_request\":$base}"
for r in $ratios; do
    read -r ir n < <(measure "$r")
    per=$((ir / n))
    echo "{\"tracing\":$r,\"requests\":$n,\"instructions_per_request\":$per,\"vs_off\":$(awk "BEGIN {printf \"%.4f\", $per / $base}")}"
done

#!/usr/bin/env bash
# What tracing costs the proxy, per request: three `kvroute serve` processes in front of
# the same trivial upstreams (tracing off, at 10% and at 100% sampling, the traced ones
# exporting every second to an OTLP sink), measured interleaved by proxy_bench, whose
# `cpu_own` ratios compare the proxies' own CPU seconds per request.
#
# usage: benches/scripts/tracing_cost.sh [run_ms] [repeats] [concurrencies]
# (defaults 3000 ms, 7 repeats, 1,16). Builds the release binaries it needs first.
# Prints proxy_bench's JSON lines; `vs_off.trace_10.cpu_own` is the 10% cost ratio.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/scripts/traced_serve_config.sh
run_ms=${1:-3000}
repeats=${2:-7}
conc=${3:-1,16}
ups=19301
sink=19305

cargo build --release --quiet --bin kvroute
cargo build --release --quiet -p kvroute-proxy --example proxy_bench
bench=target/release/examples/proxy_bench
dir=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    rm -rf "$dir"
}
trap cleanup EXIT

externals=()
port=19310
for p in off:off trace_10:0.1 trace_100:1.0; do
    name=${p%%:*}
    traced_serve_config "$dir/$name.toml" "$port" "$ups" "${p#*:}" "$sink"
    RUST_LOG=warn target/release/kvroute serve --config "$dir/$name.toml" 2>"$dir/$name.log" &
    pids+=($!)
    externals+=(--external "$name=127.0.0.1:$port@$!")
    port=$((port + 1))
done

# Waits for every proxy to listen (the upstreams and the sink are proxy_bench's).
for port in 19310 19311 19312; do
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then break; fi
        sleep 0.1
    done
done

"$bench" "$run_ms" plain --no-inproc --upstream-port "$ups" --conc "$conc" --repeats "$repeats" \
    --otlp-sink-port "$sink" --baseline off "${externals[@]}"

#!/usr/bin/env bash
# What tracing costs the proxy per request, in instructions (see callgrind_serve.sh),
# once per setting: tracing off, then at each sampling ratio.
#
# usage: benches/scripts/tracing_instructions.sh [ratios] [run_ms]
# (defaults "0 0.1 1.0", 6000 ms at concurrency 4). Needs valgrind. Builds the release
# binaries first. Prints one JSON line per setting, with the ratio to tracing off.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/scripts/traced_serve_config.sh
. benches/scripts/callgrind_serve.sh
ratios=${1:-0 0.1 1.0}
run_ms=${2:-6000}
ups=19401
sink=19405
port=19412
callgrind_prepare

# Instructions per request of one setting: `off` or a sampling ratio.
measure() {
    local cfg="$dir/$1.toml"
    traced_serve_config "$cfg" "$port" "$ups" "$1" "$sink"
    serve_instructions "$dir" "$1" "$cfg" "$ups" "$port" "$run_ms" --otlp-sink-port "$sink"
}

read -r ir n < <(measure off)
base=$((ir / n))
echo "{\"tracing\":\"off\",\"requests\":$n,\"instructions_per_request\":$base}"
for r in $ratios; do
    read -r ir n < <(measure "$r")
    per=$((ir / n))
    echo "{\"tracing\":$r,\"requests\":$n,\"instructions_per_request\":$per,\"vs_off\":$(awk "BEGIN {printf \"%.4f\", $per / $base}")}"
done

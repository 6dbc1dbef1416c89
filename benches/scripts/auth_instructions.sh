#!/usr/bin/env bash
# What a tenant's key, limits and cache isolation cost the proxy per request, in
# instructions (see callgrind_serve.sh), once per setting:
#   open     no tenants (today's proxy, the baseline);
#   key      one tenant, every request authenticated, shared cache, no limits;
#   salt     the key, and the tenant's cache isolated (its requests salted);
#   limits   the key, and every limit set (too high to refuse), shared cache;
#   all      the key, every limit and the isolated cache.
#
# usage: benches/scripts/auth_instructions.sh [settings] [run_ms]
# (defaults "key salt limits all", 6000 ms at concurrency 4; `open` always runs first).
# Needs valgrind. Builds the release binaries first. Prints one JSON line per setting,
# with the ratio to open.
set -euo pipefail
cd "$(dirname "$0")/../.."
. benches/scripts/traced_serve_config.sh
. benches/scripts/callgrind_serve.sh
settings=${1:-key salt limits all}
run_ms=${2:-6000}
ups=19421
port=19432
callgrind_prepare
# The key reaches kvroute through its environment, never a file or an argument.
export KVROUTE_BENCH_KEY="sk-bench-$RANDOM$RANDOM$RANDOM"

# The tenant section of a setting.
tenant_toml() {
    [ "$1" = open ] && return
    printf '[[tenants]]\nname = "bench"\napi_key_env = "KVROUTE_BENCH_KEY"\n'
    case $1 in salt | all) echo 'cache = "isolated"' ;; *) echo 'cache = "shared"' ;; esac
    case $1 in limits | all)
        printf 'requests_per_second = 10000000\ntokens_per_minute = 1000000000000\nconcurrent_max = 100000\n' ;;
    esac
}

# Instructions per request of one setting.
measure() {
    local cfg="$dir/$1.toml"
    traced_serve_config "$cfg" "$port" "$ups" off 0
    tenant_toml "$1" >>"$cfg"
    local bearer=()
    [ "$1" = open ] || bearer=(--external-bearer "$KVROUTE_BENCH_KEY")
    serve_instructions "$dir" "$1" "$cfg" "$ups" "$port" "$run_ms" "${bearer[@]}"
}

read -r ir n < <(measure open)
base=$((ir / n))
echo "{\"setting\":\"open\",\"requests\":$n,\"instructions_per_request\":$base}"
for s in $settings; do
    read -r ir n < <(measure "$s")
    per=$((ir / n))
    echo "{\"setting\":\"$s\",\"requests\":$n,\"instructions_per_request\":$per,\"vs_open\":$(awk "BEGIN {printf \"%.4f\", $per / $base}")}"
done

#!/usr/bin/env bash
# Runs fuzz targets for a while and prints what they did.
#
#   scripts/fuzz.sh TARGET SECONDS   one target (kv_event_decode, router_ops, trace_parse)
#   scripts/fuzz.sh all SECONDS      every target in turn, SECONDS each
#   scripts/fuzz.sh list             the targets
#
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). New inputs go
# to fuzz/target/work/TARGET (not committed); the committed seeds in fuzz/corpus/TARGET
# are read, never written. A crash lands in fuzz/artifacts/TARGET: minimize it with
# `cargo +nightly fuzz tmin TARGET FILE`, copy it to fuzz/regressions/TARGET/<name>
# and add a named test (see tests/it/fuzz_corpus.rs). Extra libFuzzer flags can go
# in FUZZ_FLAGS (for example FUZZ_FLAGS="-jobs=2 -workers=2").
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root/fuzz"

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^kvroute-fuzz$'; }

usage() {
    echo "usage: $0 TARGET|all SECONDS, or $0 list; targets: $(targets | tr '\n' ' ')" >&2
    exit 2
}

run_one() {
    local target="$1" seconds="$2"
    local work="target/work/$target" log="target/work/$target.log"
    mkdir -p "$work" "corpus/$target"
    echo "== $target: ${seconds}s"
    local status=0
    # shellcheck disable=SC2086 # FUZZ_FLAGS is a list of flags.
    cargo +nightly fuzz run "$target" "$work" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 ${FUZZ_FLAGS:-} >"$log" 2>&1 || status=$?
    # libFuzzer's last status line carries coverage (cov: edges, ft: features).
    grep -E '^#[0-9]+' "$log" | tail -n 1 || true
    grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" || true
    echo "   corpus: $(find "$work" -type f | wc -l) inputs in $work; log: fuzz/$log"
    if [ "$status" -ne 0 ]; then
        echo "!! $target stopped with status $status; the crash:" >&2
        grep -E 'panicked at|^Test unit written to|ERROR: libFuzzer' -A 2 "$log" >&2 || tail -n 30 "$log" >&2
        return "$status"
    fi
}

case "${1:-}" in
    list) targets ;;
    all)
        [ $# -eq 2 ] || usage
        failed=0
        for t in $(targets); do run_one "$t" "$2" || failed=1; done
        exit "$failed"
        ;;
    "") usage ;;
    *)
        [ $# -eq 2 ] || usage
        targets | grep -qx "$1" || usage
        run_one "$1" "$2"
        ;;
esac

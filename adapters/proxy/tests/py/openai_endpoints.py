"""Drives every vLLM endpoint through a closed kvroute gateway with the official `openai`
client: the Responses API (whole and streamed), embeddings (the client's default base64),
scoring and reranking, tokenizing, models, an unknown path, and each of them with a key
the gateway does not know.

Usage: openai_endpoints.py BASE_URL MODEL KEY. Prints one JSON object with what it saw.
"""
import json
import sys

import openai
from openai import OpenAI

base_url, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=30)
stranger = OpenAI(base_url=base_url + "/v1", api_key="sk-not-a-tenant", max_retries=0, timeout=30)
out = {}

whole = client.responses.create(model=model, instructions="Be terse.", input="What is a KV cache?",
                                max_output_tokens=4)
out["responses"] = {"object": whole.object, "status": whole.status, "text": whole.output_text,
                    "output_tokens": whole.usage.output_tokens}

events, deltas = [], []
with client.responses.stream(model=model, input="Stream a word or two.", max_output_tokens=3) as stream:
    for event in stream:
        events.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    final = stream.get_final_response()
out["responses_stream"] = {"first": events[0], "last": events[-1], "deltas": len(deltas),
                           "text_matches": "".join(deltas) == final.output_text}

emb = client.embeddings.create(model=model, input=["a prefix", "another"])
out["embeddings"] = {"count": len(emb.data), "dims": len(emb.data[0].embedding),
                     "prompt_tokens": emb.usage.prompt_tokens}

score = client.post("/score", cast_to=object, body={"model": model, "queries": "q", "documents": ["a", "q"]})
rerank = client.post("/rerank", cast_to=object, body={"model": model, "query": "q", "documents": ["a", "q"]})
tokens = client.post(base_url + "/tokenize", cast_to=object, body={"model": model, "prompt": "hello"})
out["score"] = [d["object"] for d in score["data"]]
out["rerank_best"] = rerank["results"][0]["index"]
out["tokenize_count"] = tokens["count"]

out["models"] = sorted(m.id for m in client.models.list())
out["model"] = client.models.retrieve(model).id


def status(call):
    """The status of the error `call` raises, or None if it succeeds."""
    try:
        call()
    except openai.APIStatusError as e:
        return {"status": e.status_code, "code": (e.body or {}).get("code") if isinstance(e.body, dict) else None}
    return None


out["unknown_path"] = status(lambda: client.get("/no-such-endpoint", cast_to=object))
out["unknown_model"] = status(lambda: client.embeddings.create(model="not-served-here", input="x"))
out["stranger"] = {
    "responses": status(lambda: stranger.responses.create(model=model, input="x")),
    "responses_stream": status(lambda: stranger.responses.create(model=model, input="x", stream=True)),
    "embeddings": status(lambda: stranger.embeddings.create(model=model, input="x")),
    "models": status(lambda: stranger.models.list()),
    "score": status(lambda: stranger.post("/score", cast_to=object, body={"model": model, "queries": "q", "documents": ["a"]})),
    "rerank": status(lambda: stranger.post("/rerank", cast_to=object, body={"model": model, "query": "q", "documents": ["a"]})),
    "tokenize": status(lambda: stranger.post(base_url + "/tokenize", cast_to=object, body={"prompt": "x"})),
    "detokenize": status(lambda: stranger.post(base_url + "/detokenize", cast_to=object, body={"tokens": [1]})),
}
print(json.dumps(out))

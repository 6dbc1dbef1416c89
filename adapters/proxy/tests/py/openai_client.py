"""Drives a kvroute proxy with the official `openai` client, as a user would.

Usage: openai_client.py BASE_URL MODEL. Prints one JSON object with what it saw.
"""
import json
import sys

from openai import OpenAI

base_url, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
messages = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about prefix caches."},
]

full = client.chat.completions.create(model=model, messages=messages, max_tokens=5)
raw = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=3)

pieces = []
finish = None
for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True):
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish

text = client.completions.create(model=model, prompt="The router picks", max_tokens=4)
models = [m.id for m in client.models.list()]

try:
    client.chat.completions.create(model=model, messages="not a list", max_tokens=2)
    bad_request = None
except Exception as e:  # the client raises on 4xx
    bad_request = getattr(e, "status_code", None)

print(json.dumps({
    "chat_content": full.choices[0].message.content,
    "chat_completion_tokens": full.usage.completion_tokens,
    "raw_worker_header": raw.headers.get("x-kvroute-worker"),
    "stream_text": "".join(pieces),
    "stream_chunks": len(pieces),
    "stream_finish": finish,
    "completion_text": text.choices[0].text,
    "models": models,
    "bad_request_status": bad_request,
}))

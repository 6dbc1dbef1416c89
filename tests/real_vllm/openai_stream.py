"""Streams through kvroute with the official `openai` client; prints one JSON object.

Usage: python openai_stream.py BASE_URL MODEL
"""

import json
import sys

from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
out = {}

messages = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the sea at dusk."},
]
chunks, text, finish, usage = 0, "", None, None
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens
    for choice in chunk.choices:
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
out["chat"] = {"chunks": chunks, "text": text, "finish_reason": finish, "completion_tokens": usage}

chunks, text, finish = 0, "", None
for chunk in client.completions.create(
    model=model, prompt="The router sends each request to", max_tokens=16, temperature=0, stream=True
):
    chunks += 1
    for choice in chunk.choices:
        text += choice.text or ""
        finish = choice.finish_reason or finish
out["completion"] = {"chunks": chunks, "text": text, "finish_reason": finish}
print(json.dumps(out))

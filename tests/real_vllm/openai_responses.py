"""The Responses API through kvroute with the official `openai` client, whole and
streamed; prints one JSON object.

Usage: python openai_responses.py BASE_URL MODEL
"""

import json
import sys

from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
ask = dict(model=model, instructions="You are a terse assistant.", input="Name three colours of the sea at dusk.",
           max_output_tokens=12, temperature=0)

whole = client.responses.create(**ask)
events, deltas = [], []
with client.responses.stream(**ask) as stream:
    for event in stream:
        events.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    final = stream.get_final_response()
print(json.dumps({
    "whole": {"status": whole.status, "text": whole.output_text, "output_tokens": whole.usage.output_tokens},
    "stream": {"first": events[0], "last": events[-1], "deltas": len(deltas), "text": "".join(deltas),
               "final_text": final.output_text},
}))

"""Reference outputs from Hugging Face transformers for the parity tests.

Reads a job as JSON on stdin: {"dir": model folder, "chats": [...], "texts": [...]}.
Each chat is {"messages", "tools", "add_generation_prompt", "kwargs"}; each text is a
string. Writes JSON on stdout: per chat the rendered text, the ids of encoding that text
without special tokens, and the ids of apply_chat_template(tokenize=True), or the error;
per text the ids with and without special tokens.
"""

import json
import os
import sys

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import AutoTokenizer  # noqa: E402


def render(tok, chat):
    kwargs = dict(chat.get("kwargs") or {})
    common = dict(
        tools=chat.get("tools"),
        add_generation_prompt=chat.get("add_generation_prompt", True),
        **kwargs,
    )
    try:
        text = tok.apply_chat_template(chat["messages"], tokenize=False, **common)
        ids_chat = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=False, **common)
    except Exception as e:  # the Rust side expects a typed error for these
        return {"error": f"{type(e).__name__}: {e}"}
    ids_text = tok.encode(text, add_special_tokens=False)
    return {"text": text, "ids_text": list(ids_text), "ids_chat": list(ids_chat)}


def main():
    job = json.load(sys.stdin)
    tok = AutoTokenizer.from_pretrained(job["dir"], local_files_only=True)
    out = {
        "chats": [render(tok, c) for c in job.get("chats", [])],
        "texts": [
            {
                "plain": tok.encode(t, add_special_tokens=False),
                "special": tok.encode(t, add_special_tokens=True),
            }
            for t in job.get("texts", [])
        ],
    }
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()

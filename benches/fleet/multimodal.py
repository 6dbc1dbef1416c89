"""The `multimodal` workload: chats about images, each turn resending the images.

Every conversation opens with a system prompt (one of a few shared ones) and a user
message holding one or two images and a question; each later turn resends the whole
history (the images included, as a vision chat client does) with the model's answer and
a new question appended, and is sent its think time after the turn before finished.
Images are small PNGs made from the seed with the standard library (zlib, struct), sent
as `data:` URLs in `image_url` parts of a streamed `/v1/chat/completions`.

The sim fleet serves a generated LLaVA-style model: the word-level tokenizer of `words`
plus an `<image>` word, and a `config.json` whose `vision_config` gives every image
`IMAGE_TOKENS` placeholder tokens. The sim-workers and kvroute read the same folder, so
both identify and expand an image as vLLM does; a request's `tokens` are the prompt as
the workers hold it, each image's placeholders written as `-(1 + image id)`, so that
equal tokens mean equal cache blocks, as for the text workloads. The real fleet serves
`gen_vlm.py`'s LLaVA (64 tokens an image, `tokens_per_image` of its folder); its chat
template marks each message's start and end with a token, where `tokens` count one, so
there they are the prompt's shape (its shared prefixes and images), not its exact ids.
"""

import base64
import json
import math
import random
import struct
import zlib
from pathlib import Path

import words

IMAGE_WORD = "<image>"
# LLaVA-1.5's vision tower: 336-pixel images in 14-pixel patches, 576 tokens an image.
VISION_CONFIG = {"image_size": 336, "patch_size": 14}
IMAGE_TOKENS = (336 // 14) ** 2
MM_ITEMS_MAX = 4  # images a request may carry, for kvroute's [media] and the workers

MM_CONVERSATIONS = 300
MM_SYSTEMS = 4
MM_SYSTEM_WORDS = (150, 600)
MM_IMAGES = (1, 2)
MM_IMAGE_SIDE_PX = (24, 64)
MM_TURNS = (2, 8)
MM_QUESTION_WORDS = (15, 120)
MM_ANSWER_WORDS = (30, 250)
MM_THINK_S_MEAN = 2.0  # model seconds a user reads and types between turns (exponential)
MM_START_RATE_PER_S = 1.0  # conversation starts per model second, before scaling


def png(width, height, seed):
    """An RGB PNG of `width` x `height` seeded pixels (unfiltered rows, deflated)."""
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + bytes(rng.getrandbits(8) for _ in range(3 * width)) for _ in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def image(seed, image_id):
    """Image `image_id` of the workload seeded `seed`: its PNG bytes, the same every run."""
    rng = random.Random(f"{seed}/image/{image_id}")
    w, h = rng.randint(*MM_IMAGE_SIDE_PX), rng.randint(*MM_IMAGE_SIDE_PX)
    return png(w, h, f"{seed}/pixels/{image_id}")


def data_url(png_bytes):
    return "data:image/png;base64," + base64.b64encode(png_bytes).decode("ascii")


def tokens_per_image(model_dir: Path):
    """Placeholder tokens a LLaVA model folder gives each image: its vision tower's patches
    ((image_size / patch_size)^2, the class token dropped)."""
    vision = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["vision_config"]
    return (vision["image_size"] // vision["patch_size"]) ** 2


def image_tokens(image_id, per_image=IMAGE_TOKENS):
    """How a request's `tokens` write the placeholders of image `image_id`."""
    return (-(1 + image_id),) * per_image


def prompt_tokens(chat, per_image=IMAGE_TOKENS):
    """The prompt the workers hold for `chat` (messages of (role, word ids, image ids)):
    the bench template renders `role content` per message, then `assistant`; a role is
    one unknown word (id 0); the string content format puts each image's placeholder
    before the message's text."""
    out = []
    for _role, ids, images in chat:
        out.append(0)
        for i in images:
            out.extend(image_tokens(i, per_image))
        out.extend(ids)
    out.append(0)
    return tuple(out)


def generate(spec, vocab, request_cls):
    """The workload's requests (`request_cls` is `workloads.Request`)."""
    rng, k = random.Random(spec.seed), spec.size_scale
    n = lambda bounds: max(1, round(rng.randint(*bounds) * k))  # noqa: E731
    systems = [tuple(vocab.draw(rng, n(MM_SYSTEM_WORDS))) for _ in range(MM_SYSTEMS)]
    out, start, next_image = [], 0.0, 0
    limit = spec.requests_max or math.inf
    for c in range(MM_CONVERSATIONS):
        if len(out) >= limit:
            break
        start += rng.expovariate(MM_START_RATE_PER_S)
        images = tuple(range(next_image, next_image + rng.randint(*MM_IMAGES)))
        next_image += len(images)
        chat = [("system", systems[rng.randrange(MM_SYSTEMS)], ()),
                ("user", tuple(vocab.draw(rng, n(MM_QUESTION_WORDS))), images)]  # fmt: skip
        prev = None
        for _ in range(rng.randint(*MM_TURNS)):
            tokens = prompt_tokens(chat, spec.tokens_per_image)
            if len(out) >= limit or len(tokens) > spec.prompt_tokens_max:
                break
            answer = min(n(MM_ANSWER_WORDS), spec.output_tokens_max)
            gap = 0.0 if prev is None else min(rng.expovariate(1 / MM_THINK_S_MEAN), 8 * MM_THINK_S_MEAN)
            req = request_cls(index=len(out), arrival_s=start, tokens=tokens, output_tokens=answer,
                              group=f"m{c}", after=prev, gap_s=round(gap, 4), chat=tuple(chat))  # fmt: skip
            out.append(req)
            prev = req.index
            chat += [("assistant", tuple(vocab.draw(rng, answer)), ()),
                     ("user", tuple(vocab.draw(rng, n(MM_QUESTION_WORDS))), ())]  # fmt: skip
    return out


def messages(chat, vocab, seed):
    """`chat` as OpenAI chat messages: text as words, images as `image_url` parts."""
    out = []
    for role, ids, images in chat:
        if not images:
            out.append({"role": role, "content": vocab.text(ids)})
            continue
        parts = [{"type": "image_url", "image_url": {"url": data_url(image(seed, i))}} for i in images]
        out.append({"role": role, "content": parts + [{"type": "text", "text": vocab.text(ids)}]})
    return out


def chat_body(model, msgs, output_tokens):
    """A streamed chat completion of exactly `output_tokens` tokens."""
    return json.dumps({
        "model": model, "messages": msgs, "max_tokens": output_tokens, "min_tokens": output_tokens,
        "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip


def write_model_dir(dir_path: Path):
    """The generated tokenizer with an `<image>` word, and a LLaVA `config.json` giving
    each image `IMAGE_TOKENS` tokens; returns the text words (prompts draw only these)."""
    vocab = words.write_model_dir(dir_path)
    tok_path = dir_path / "tokenizer.json"
    tok = json.loads(tok_path.read_text(encoding="utf-8"))
    image_id = len(vocab)
    tok["model"]["vocab"][IMAGE_WORD] = image_id
    tok_path.write_text(json.dumps(tok), encoding="utf-8")
    config = {"model_type": "llava", "image_token_index": image_id, "vision_feature_select_strategy": "default",
              "vision_config": {"model_type": "clip_vision_model", **VISION_CONFIG},
              "text_config": {"model_type": "llama", "vocab_size": image_id + 1}}  # fmt: skip
    (dir_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return vocab

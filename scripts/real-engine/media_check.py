"""vLLM's own answers about images, for kvroute-media's tests to compare with.

Runs in the engine venv (install.sh builds it); imports vLLM's wheel and asks it, never
a copy of its logic:

  media_check.py images OUT_DIR
      writes seeded PNG, JPEG and WebP images of several modes and orientations to
      OUT_DIR, and prints one JSON object per image: its file name, data URL, what
      Pillow says (size, mode, size after vLLM's `normalize_image`), vLLM's identifier
      for each hash algorithm (data URL -> `MediaConnector.fetch_image` ->
      `MultiModalDataParser` -> `ProcessorInputs.get_mm_hashes`), and the placeholder
      tokens transformers' `smart_resize` gives a Qwen2-VL processor.

  media_check.py blocks
      reads one request from stdin as JSON ({"block_size", "tokens", "cache_salt",
      "lora_name", "items": [{"identifier", "offset", "length"}], "extra_keys":
      [[[id, off], ...] per block]}), builds a vLLM `Request` with those
      `mm_features` (and a `LoRARequest` when "lora_name" is set) and its block
      hasher, and prints whether vLLM's block hashes equal the chain of
      `hash_block_tokens` over the given per-block keys, with vLLM's own per-block keys
      and the `BlockStored` event vLLM would publish for them (msgpack, hex).
"""

import base64
import io
import json
import random
import sys
from pathlib import Path

MODEL_ID = "kvroute/test-vlm"
ALGORITHMS = ("blake3", "sha256", "sha512")
# A Qwen2-VL processor's settings for the token counts: patch 14, merge 2, and a
# max_pixels small enough that large images are scaled down.
QWEN = {"patch_size": 14, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}


def _images():
    from PIL import Image

    rng = random.Random(26)

    def noise(mode, size):
        im = Image.new("RGBA", size)
        im.putdata([tuple(rng.randrange(256) for _ in range(4)) for _ in range(size[0] * size[1])])
        return im if mode == "RGBA" else im.convert("RGB").convert(mode)

    def gradient(size):
        im = Image.new("RGB", size)
        im.putdata([(x % 256, y % 256, (x + y) % 256) for y in range(size[1]) for x in range(size[0])])
        return im

    def save(im, fmt, **kw):
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        return buf.getvalue()

    def exif(orientation):
        e = Image.Exif()
        e[0x0112] = orientation
        return e.tobytes()

    yield "rgb.png", save(noise("RGB", (37, 23)), "PNG")
    yield "rgba.png", save(noise("RGBA", (30, 40)), "PNG")
    yield "gray.png", save(noise("L", (64, 9)), "PNG")
    yield "palette.png", save(noise("RGB", (20, 20)).convert("P"), "PNG")
    yield "gray16.png", save(noise("I;16", (11, 13)), "PNG")
    yield "rotated.png", save(noise("RGB", (50, 20)), "PNG", exif=exif(6))
    yield "rgb.jpg", save(gradient((640, 480)), "JPEG", quality=80)
    yield "gray.jpg", save(noise("L", (33, 17)), "JPEG")
    yield "cmyk.jpg", save(noise("CMYK", (16, 24)), "JPEG")
    yield "rotated.jpg", save(noise("RGB", (90, 30)), "JPEG", exif=exif(8))
    yield "mirrored.jpg", save(noise("RGB", (90, 30)), "JPEG", exif=exif(2))
    yield "progressive.jpg", save(gradient((300, 200)), "JPEG", progressive=True)
    yield "lossy.webp", save(noise("RGB", (45, 27)), "WEBP", quality=70)
    yield "lossless.webp", save(noise("RGB", (21, 34)), "WEBP", lossless=True)
    yield "alpha.webp", save(noise("RGBA", (40, 25)), "WEBP", lossless=True)
    yield "alpha-lossy.webp", save(noise("RGBA", (40, 25)), "WEBP", quality=60)
    yield "rotated.webp", save(noise("RGB", (60, 20)), "WEBP", exif=exif(5))
    yield "wide.png", save(gradient((1000, 40)), "PNG")


def images(out_dir):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    from vllm.multimodal.image import normalize_image
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    connector = MediaConnector()
    for name, data in _images():
        (out / name).write_bytes(data)
        url = "data:image/x;base64," + base64.b64encode(data).decode()
        item = connector.fetch_image(url)
        items = MultiModalDataParser().parse_mm_data({"image": [item]})
        ids = {
            algo: ProcessorInputs(prompt=[], mm_data_items=items).get_mm_hashes(MODEL_ID, algo)["image"][0]
            for algo in ALGORITHMS
        }
        pil = Image.open(io.BytesIO(data))
        shown = normalize_image(Image.open(io.BytesIO(data)))
        factor = QWEN["patch_size"] * QWEN["merge_size"]
        h, w = smart_resize(shown.height, shown.width, factor, QWEN["min_pixels"], QWEN["max_pixels"])
        tokens = (h // QWEN["patch_size"]) * (w // QWEN["patch_size"]) // QWEN["merge_size"] ** 2
        print(json.dumps({
            "file": name,
            "size": list(pil.size),
            "mode": pil.mode,
            "display_size": list(shown.size),
            "ids": ids,
            "qwen_tokens": tokens,
        }))


def blocks():
    from vllm.distributed.kv_events import BlockStored, EventBatch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request
    import msgspec

    req = json.load(sys.stdin)
    bs = req["block_size"]
    kcu.init_none_hash(sha256_cbor)
    features = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=it["identifier"],
            mm_position=PlaceholderRange(offset=it["offset"], length=it["length"]),
        )
        for it in req["items"]
    ]
    lora = req.get("lora_name")
    lora_request = LoRARequest(lora_name=lora, lora_int_id=1, lora_path="lora-path") if lora else None
    request = Request(
        request_id="r", prompt_token_ids=req["tokens"], sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None, mm_features=features, cache_salt=req.get("cache_salt"), lora_request=lora_request,
        block_hasher=kcu.get_request_block_hasher(bs, sha256_cbor),
    )
    # vLLM's own per-block keys, then the chain over the keys kvroute gave.
    theirs, ours, parent, cursor = [], [], None, 0
    for b in range(len(req["tokens"]) // bs):
        keys, cursor = kcu.generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, cursor)
        theirs.append(keys)
        given = [("lora", lora, "lora-path")] if lora else []
        given += [("mm", k[0], k[1]) for k in req["extra_keys"][b]]
        if b == 0 and req.get("cache_salt"):
            given.append(("cache_salt", req["cache_salt"]))
        parent = kcu.hash_block_tokens(sha256_cbor, parent, req["tokens"][b * bs:(b + 1) * bs], tuple(given) or None)
        ours.append(parent)
    event = BlockStored(
        block_hashes=[int.from_bytes(h[:8], "big") for h in request.block_hashes], parent_block_hash=None,
        token_ids=req["tokens"][: len(request.block_hashes) * bs], block_size=bs, lora_id=None, medium="GPU",
        lora_name=lora, extra_keys=kcu.to_event_extra_keys(theirs),
    )
    payload = msgspec.msgpack.Encoder().encode(EventBatch(ts=1.0, events=[event]))
    print(json.dumps({
        "blocks": len(request.block_hashes),
        "equal": list(request.block_hashes) == ours,
        "vllm_keys": [[list(k) for k in (keys or ())] for keys in theirs],
        "event": payload.hex(),
    }))


if __name__ == "__main__":
    {"images": lambda: images(sys.argv[2]), "blocks": blocks}[sys.argv[1]]()

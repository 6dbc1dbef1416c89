"""Generates the seeded vision-language models the real-engine image tests serve with vLLM.

Like gen_model.py, nothing is downloaded: a model is randomly initialised from
transformers' config classes, with a byte-level BPE tokenizer trained on Python's own
stdlib sources, an image processor and a processor built in code, and a chat template
that renders an image part as the family's image text. Every random draw is seeded.
Two families (`--family`):

* `llava`: `LlavaForConditionalGeneration`, a CLIP vision tower (112 px, patch 14), a
  two-layer projector and a small Llama. Every image becomes (112 / 14)^2 = 64 `<image>`
  tokens (`vision_feature_select_strategy = "default"` drops CLIP's class token): the
  CLIP processor resizes and crops it to 112 px square.
* `qwen2_vl`: `Qwen2VLForConditionalGeneration`, a Qwen2-VL vision tower (patch 14,
  merge 2) and a small Qwen2 with M-RoPE. An image becomes `<|image_pad|>` tokens by its
  size: transformers' `smart_resize` to a multiple of 28 px between 56*56 and 28*28*64
  pixels, then one token per 28 x 28 (so at most 64).

Idempotent: `generator.json` in the output folder records GENERATOR_VERSION, the family,
its shapes and its chat template; when it matches, nothing is written. `--text fleet`
gives the LLaVA the text model's size instead (the fleet benchmark's).
"""

import argparse
import json
import os
import random
import sys
from pathlib import Path

from gen_model import SHAPE as TEXT_MODEL_SHAPE
from gen_model import corpus_lines  # the same corpus, a smaller share of it

# Bump whenever anything below changes what is written.
GENERATOR_VERSION = 1
SEED = 20261226

TEXT = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
# `--text fleet`: the text model's shape (gen_model.py's), so that the fleet benchmark's
# image chats cost the CPU servers what its text workloads do and a cache hit matters
# more than a router's own time. LLaVA only (Qwen2-VL's vision tower is sized to TEXT).
# The vocabulary and positions stay TEXT's: this folder's tokenizer and context.
FLEET_TEXT = {
    **TEXT,
    **{k: TEXT_MODEL_SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads")},
}  # fmt: skip
CORPUS_BYTES_MAX = 1 << 20
SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
    "<image>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
]
# CLIP's normalisation constants (the processors' defaults, written out so the saved
# configs do not depend on a transformers version's defaults).
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

FAMILIES = {
    "llava": {
        "image_text": "<image>",
        "image_token": "<image>",
        "vision": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 112,
            "patch_size": 14,
            "projection_dim": 64,
        },
    },
    "qwen2_vl": {
        "image_text": "<|vision_start|><|image_pad|><|vision_end|>",
        "image_token": "<|image_pad|>",
        "vision": {
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": TEXT["hidden_size"],
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "pixels": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64},
        # M-RoPE's (temporal, height, width) split of a 64-wide head's 32 frequencies.
        "mrope_section": [8, 12, 12],
    },
}


def chat_template(image_text):
    """Turns with string or part-list content; an image part renders as `image_text`,
    whose image token vLLM's processor then expands to the image's placeholder tokens.
    No newlines: `<|user|>text<|end|>...<|assistant|>`."""
    return (
        "{%- for m in messages %}{{ '<|' + m['role'] + '|>' }}"
        "{%- if m['content'] is string %}{{ m['content'] }}"
        "{%- elif m['content'] %}{%- for part in m['content'] %}"
        "{%- if part['type'] == 'text' %}{{ part['text'] }}"
        "{%- elif part['type'] in ('image', 'image_url') %}" + image_text + "{%- endif %}"
        "{%- endfor %}{%- endif %}<|end|>"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
    )


def say(msg):
    print(f"[gen_vlm] {msg}", file=sys.stderr, flush=True)


def make_tokenizer(family):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(CORPUS_BYTES_MAX), trainer=trainer)
    extra = {"image_token": FAMILIES[family]["image_token"]}
    if family == "qwen2_vl":
        extra["video_token"] = "<|video_pad|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        extra_special_tokens=extra,
        model_max_length=TEXT["max_position_embeddings"],
    )


def llava_processor(tok, template):
    from transformers import CLIPImageProcessor, LlavaProcessor

    vision = FAMILIES["llava"]["vision"]
    side = vision["image_size"]
    images = CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": side},
        resample=3,
        do_center_crop=True,
        crop_size={"height": side, "width": side},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=vision["patch_size"],
        vision_feature_select_strategy="default",
        chat_template=template,
        image_token="<image>",
        num_additional_image_tokens=1,
    )


def qwen2_vl_processor(tok, template):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    fam = FAMILIES["qwen2_vl"]
    v = fam["vision"]
    common = {
        "patch_size": v["patch_size"],
        "merge_size": v["spatial_merge_size"],
        "temporal_patch_size": v["temporal_patch_size"],
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        **fam["pixels"],
    }
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(**common),
        chat_template=template,
    )


def make_processor(out: Path, tok, family):
    template = chat_template(FAMILIES[family]["image_text"])
    make = llava_processor if family == "llava" else qwen2_vl_processor
    make(tok, template).save_pretrained(out)
    # The tokenizer alone renders chats too (vLLM may load only it).
    tok.chat_template = template
    tok.save_pretrained(out)


# transformers 5 names the CLIP tower's weights without its `vision_model.` level,
# which vLLM's LLaVA loader (0.32) does not map; LLaVA's weights are written under the
# names it loads as they are. Qwen2-VL's names are mapped by vLLM.
LLAVA_RENAMES = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def llava_name(name):
    for old, new in LLAVA_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    raise ValueError(f"unexpected weight {name}")


def llava_model(tok):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = FAMILIES["llava"]["vision"]
    text = LlamaConfig(
        **{**TEXT, "vocab_size": len(tok)},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**vision),
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=(vision["image_size"] // vision["patch_size"]) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
    )
    return cfg, LlavaForConditionalGeneration(cfg), llava_name


def qwen2_vl_model(tok):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    fam = FAMILIES["qwen2_vl"]
    ids = tok.convert_tokens_to_ids
    text = {
        **TEXT,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": fam["mrope_section"]},
    }
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=fam["vision"],
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        architectures=["Qwen2VLForConditionalGeneration"],
    )
    return cfg, Qwen2VLForConditionalGeneration(cfg), lambda name: name


def make_model(out: Path, tok, family):
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    cfg, model, rename = (llava_model if family == "llava" else qwen2_vl_model)(tok)
    model = model.to(torch.float32)
    cfg.save_pretrained(out)
    weights = {rename(k): v.contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--out", required=True, help="the model folder (created)")
    ap.add_argument("--text", choices=("test", "fleet"), default="test",
                    help="the language model's size: the tests' (2 layers, 128 wide) or the fleet "
                    "benchmark's (6 layers, 768 wide; llava only)")  # fmt: skip
    args = ap.parse_args()
    out, family = Path(args.out), args.family
    if args.text == "fleet":
        if family != "llava":
            ap.error("--text fleet is for --family llava")
        TEXT.update(FLEET_TEXT)
    stamp = {
        "generator_version": GENERATOR_VERSION,
        "seed": SEED,
        "family": family,
        "text": TEXT,
        "family_shape": FAMILIES[family],
        "special_tokens": SPECIAL_TOKENS,
        "chat_template": chat_template(FAMILIES[family]["image_text"]),
    }
    record = out / "generator.json"
    if record.exists() and json.loads(record.read_text()) == stamp:
        say(f"{family} model present (generator {GENERATOR_VERSION})")
        return
    random.seed(SEED)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    say("training the byte-level BPE tokenizer on Python's stdlib sources")
    tok = make_tokenizer(family)
    say(f"writing the {family} processor")
    make_processor(out, tok, family)
    say(f"initialising the {family} model: text {TEXT}, {FAMILIES[family]}")
    make_model(out, tok, family)
    record.write_text(json.dumps(stamp, indent=2))
    say(f"model written to {out}")


if __name__ == "__main__":
    main()

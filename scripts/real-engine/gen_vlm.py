"""Generates the seeded vision-language model the real-engine image tests serve with vLLM.

Like gen_model.py, nothing is downloaded: a randomly initialised LLaVA
(`LlavaForConditionalGeneration`: a CLIP vision tower, a two-layer projector and a small
Llama), a byte-level BPE tokenizer trained on Python's own stdlib sources with an
`<image>` token, a CLIP image processor and a LLaVA processor, all built in code from
transformers' classes and saved with a chat template that renders image parts as
`<image>`. Every random draw is seeded.

An image becomes (IMAGE_SIZE / PATCH_SIZE)^2 = 64 placeholder tokens
(`vision_feature_select_strategy = "default"` drops CLIP's class token), whatever its
size: the CLIP processor resizes and crops it to IMAGE_SIZE pixels square.

Idempotent: `generator.json` in the output folder records GENERATOR_VERSION and the
shapes and the chat template; when it matches, nothing is written.
"""

import argparse
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

# Bump whenever anything below changes what is written.
GENERATOR_VERSION = 1
SEED = 20261226

IMAGE_SIZE = 112
PATCH_SIZE = 14
TEXT = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}
VISION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "projection_dim": 64,
}
CORPUS_BYTES_MAX = 1 << 20
IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", IMAGE_TOKEN]
# CLIP's normalisation constants (the processor's defaults, written out so the saved
# config does not depend on a transformers version's defaults).
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# Turns with string or part-list content; an image part renders as the image token,
# which vLLM's processor then expands to the image's placeholder tokens. No newlines:
# `<|user|>text<|end|>...<|assistant|>`.
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|' + m['role'] + '|>' }}"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{%- for part in m['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}" + IMAGE_TOKEN + "{%- endif %}"
    "{%- endfor %}{%- endif %}<|end|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)


def say(msg):
    print(f"[gen_vlm] {msg}", file=sys.stderr, flush=True)


def corpus_lines():
    """Python's own stdlib sources, in sorted order, up to CORPUS_BYTES_MAX."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield from text.splitlines()
        if total >= CORPUS_BYTES_MAX:
            return


def make_tokenizer():
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
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=TEXT["max_position_embeddings"],
    )


def make_processor(out: Path, tok):
    from transformers import CLIPImageProcessor, LlavaProcessor

    images = CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": IMAGE_SIZE},
        resample=3,
        do_center_crop=True,
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_convert_rgb=True,
    )
    proc = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    proc.save_pretrained(out)
    # The tokenizer alone renders chats too (vLLM may load only it).
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)


# transformers 5 names the CLIP tower's weights without its `vision_model.` level,
# which vLLM's LLaVA loader (0.32) does not map; weights are written under the names
# it loads as they are.
RENAMES = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def vllm_name(name):
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    raise ValueError(f"unexpected weight {name}")


def make_model(out: Path, tok):
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(SEED)
    text = LlamaConfig(
        **{**TEXT, "vocab_size": len(tok)},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
        architectures=["LlavaForConditionalGeneration"],
    )
    model = LlavaForConditionalGeneration(cfg).to(torch.float32)
    cfg.save_pretrained(out)
    save_file(
        {vllm_name(k): v.contiguous() for k, v in model.state_dict().items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the model folder (created)")
    args = ap.parse_args()
    out = Path(args.out)
    stamp = {
        "generator_version": GENERATOR_VERSION,
        "seed": SEED,
        "text": TEXT,
        "vision": VISION,
        "chat_template": CHAT_TEMPLATE,
    }
    record = out / "generator.json"
    if record.exists() and json.loads(record.read_text()) == stamp:
        say(f"model present (generator {GENERATOR_VERSION})")
        return
    random.seed(SEED)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    say("training the byte-level BPE tokenizer on Python's stdlib sources")
    tok = make_tokenizer()
    say("writing the processor (CLIP image processor, LLaVA processor)")
    make_processor(out, tok)
    say(f"initialising the model: text {TEXT}, vision {VISION}")
    make_model(out, tok)
    record.write_text(json.dumps(stamp, indent=2))
    say(f"model written to {out}")


if __name__ == "__main__":
    main()

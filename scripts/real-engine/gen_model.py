"""Generates the seeded model the real-engine tests serve with vLLM.

No model can be downloaded in CI, so this makes one: a randomly initialised
`LlamaForCausalLM` (bf16) and a byte-level BPE tokenizer trained on text that ships with
Python itself (its standard library sources), saved with a chat template that handles
system prompts, multi-turn conversations and tools. A small random LoRA adapter is
written beside it. Every random draw is seeded, so two runs on the same machine write
identical weights and token ids.

Idempotent: `generator.json` in the output folder records GENERATOR_VERSION and the
shape; when it matches, nothing is written.

The model is sized so a prefill of 1k uncached tokens costs well above the ~50 ms of
scheduling noise an idle vLLM CPU engine shows, while a 2-server suite stays fast.
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
SEED = 20261201

SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 4096,
}
LORA = {"name": "sql-lora", "rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
CORPUS_BYTES_MAX = 6 << 20
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"]

# System, tools, multi-turn, tool calls and tool results; ends with the assistant header
# when asked for a generation prompt. Written for both Jinja2 (vLLM) and minijinja
# (kvroute's tokenizer adapter).
CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>\nTools you can call:\n"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|end|>\n{%- endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>\n"
    "{%- if m['content'] is string %}{{ m['content'] }}"
    "{%- elif m['content'] %}{%- for part in m['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if m['tool_calls'] %}{%- for c in m['tool_calls'] %}\n"
    "call {{ c['function']['name'] }} {{ c['function']['arguments'] }}{%- endfor %}{%- endif %}"
    "<|end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}"
)


def say(msg):
    print(f"[gen_model] {msg}", file=sys.stderr, flush=True)


def corpus_lines(bytes_max=CORPUS_BYTES_MAX):
    """Python's own stdlib sources, in sorted order, up to `bytes_max` (gen_vlm.py reads
    less)."""
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
        if total >= bytes_max:
            return


def make_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=SHAPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        **{**SHAPE, "vocab_size": len(tok)},
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # No sampling defaults: requests say what they want.
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}))


def make_lora(out: Path):
    """A rank-8 adapter on q_proj/v_proj with random A and B (B non-zero, so it matters)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(SEED + 1)
    h, r = SHAPE["hidden_size"], LORA["rank"]
    tensors = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        for proj in LORA["targets"]:
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = (torch.randn(r, h, generator=gen) * 0.02).contiguous()
            tensors[f"{base}.lora_B.weight"] = (torch.randn(h, r, generator=gen) * 0.02).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": r,
        "lora_alpha": LORA["alpha"],
        "lora_dropout": 0.0,
        "target_modules": LORA["targets"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the model folder (created)")
    args = ap.parse_args()
    out = Path(args.out)
    stamp = {"generator_version": GENERATOR_VERSION, "seed": SEED, "shape": SHAPE, "lora": LORA}
    record = out / "generator.json"
    if record.exists() and json.loads(record.read_text()) == stamp:
        say(f"model present (generator {GENERATOR_VERSION})")
        return
    random.seed(SEED)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    say("training the byte-level BPE tokenizer on Python's stdlib sources")
    tok = make_tokenizer(out)
    say(f"initialising the model {SHAPE}")
    make_model(out, tok)
    say(f"writing LoRA adapter {LORA['name']}")
    make_lora(out / "lora" / LORA["name"])
    record.write_text(json.dumps(stamp, indent=2))
    say(f"model written to {out}")


if __name__ == "__main__":
    main()

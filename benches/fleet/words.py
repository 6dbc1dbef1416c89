"""A generated word-level tokenizer, and prompts built from its words.

The fleet benchmark needs a real `tokenizer.json` that the sim-workers, kvroute and the
peers all read, and prompts whose token count is known without running it. A WordLevel
model with a whitespace pre-tokenizer does both: every word of the vocabulary is one
token, so a prompt of n words joined by single spaces is exactly n tokens for every
reader. The words are made of syllables, lowercase letters only (the pre-tokenizer would
split anything else).
"""

import json
import random
from pathlib import Path

VOCAB_SIZE = 8192
UNK = "[UNK]"
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def vocabulary(size=VOCAB_SIZE):
    """`size` distinct words (index 0 is the unknown token), the same on every run."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = [a + b for a in syllables for b in syllables]
    words += [a + b + c for a in syllables[:20] for b in syllables for c in syllables]
    if len(words) < size - 1:
        raise ValueError(f"only {len(words)} words for a vocabulary of {size}")
    return [UNK] + words[: size - 1]


def tokenizer_json(words):
    """A Hugging Face `tokenizer.json` (WordLevel, whitespace split) over `words`."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": 0, "content": UNK, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": UNK},
    }


# A ChatML-style template, for routers that render chat requests; the benchmark sends
# completions, so it only has to be valid.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def write_model_dir(dir_path: Path, size=VOCAB_SIZE):
    """Writes `tokenizer.json`, `tokenizer_config.json` and a minimal `config.json` into
    `dir_path` (created); returns the vocabulary."""
    words = vocabulary(size)
    dir_path.mkdir(parents=True, exist_ok=True)
    (dir_path / "tokenizer.json").write_text(json.dumps(tokenizer_json(words)), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK, "model_max_length": 1 << 20,
              "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (dir_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (dir_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": size}), encoding="utf-8")
    return words


class Vocab:
    """Word ids to text. Ids 1.. are words; 0 is never drawn."""

    def __init__(self, words, lead=""):
        self.words = words
        self.lead = lead

    @classmethod
    def generated(cls, size=VOCAB_SIZE):
        return cls(vocabulary(size))

    @classmethod
    def from_tokens(cls, token_texts):
        """A real tokenizer's whole-word tokens (" word", each one token): a prompt is
        every word behind a space, so it still encodes to one token a word."""
        return cls([UNK] + [t.strip() for t in token_texts], lead=" ")

    def text(self, ids):
        return self.lead + " ".join(self.words[i] for i in ids)

    def draw(self, rng: random.Random, n):
        """`n` random word ids from `rng`."""
        top = len(self.words) - 1
        return [rng.randint(1, top) for _ in range(n)]

    def block(self, seed, key, n):
        """`n` word ids fixed by (`seed`, `key`): the same block for the same key on every run."""
        return self.draw(random.Random(f"{seed}/{key}"), n)

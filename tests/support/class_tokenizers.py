"""Tokenizers of a model family's own transformers class (LlamaTokenizer, Qwen2Tokenizer, GPT2Tokenizer), built
offline: a BPE vocabulary trained on a fixed corpus, handed to the class, saved with save_pretrained beside a tiny
checkpoint of that family, with tokenizer_config.json naming the class as Hub checkpoints do (LlamaTokenizerFast,
...). Also a Llama-2-style tokenizer.json (sentencepiece's prefix space as a normalizer), which transformers 5's
LlamaTokenizer rebuilds with a pre-tokenizer instead and so encodes differently."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.support.bpe_tokenizer import CORPUS
from tests.support.hf_models import save_hf_model

BYTES = [f"<0x{i:02X}>" for i in range(256)]  # sentencepiece's byte-fallback pieces
LLAMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                  "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# family -> the specials first in its vocabulary (ids 0, 1, 2 = the tiny config's padding, BOS, EOS), whether the
# vocabulary is byte-level, and tokenizer_config.json as the family's Hub checkpoints have it: Llama 2's and Qwen2.5's
# name their class; GPT-2's names none (AutoTokenizer takes the model type's, with its special tokens).
FAMILIES: dict[str, tuple[list[str], bool, dict[str, Any]]] = {
    "llama": (["<unk>", "<s>", "</s>"], False,
              {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "pad_token": None, "add_bos_token": True, "add_eos_token": False, "legacy": False,
               "clean_up_tokenization_spaces": False, "chat_template": LLAMA_TEMPLATE}),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], True,
              {"tokenizer_class": "Qwen2TokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 32768,
               "split_special_tokens": False, "chat_template": CHATML}),
    "gpt2": (["<|endoftext|>", "<s>", "</s>"], True,
             {"model_max_length": 1024, "chat_template": CHATML.replace("<|im_start|>", "<s>").replace("<|im_end|>",
                                                                                                      "</s>")}),
}
MODEL_VOCAB = 600  # the tiny model's: past every tokenizer's ids


def trained_bpe(specials: list[str], byte_level: bool) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A BPE vocabulary and merges trained on CORPUS: byte-level (GPT-2's alphabet), or sentencepiece-style (▁ for
    spaces, with byte-fallback pieces)."""
    tok = Tokenizer(models.BPE())
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300 + len(BYTES), special_tokens=specials + BYTES)
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges  # type: ignore[return-value]


def save_class_checkpoint(family: str, d: Path, **config: Any) -> None:
    """A tiny `family` checkpoint in d whose tokenizer.json is saved by the family's transformers class (GPT-2's by
    the model type's), its specials added tokens; tokenizer_config.json is FAMILIES' updated by `config` (which may
    name another class)."""
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING, tokenizer_class_from_name

    specials, byte_level, hub = FAMILIES[family]
    save_hf_model(family, d, vocab_size=MODEL_VOCAB)
    vocab, merges = trained_bpe(specials, byte_level)
    settings = {**hub, **config}
    name = hub.get("tokenizer_class")  # the family's, whatever `config` names
    cls = tokenizer_class_from_name(name) if name else TOKENIZER_MAPPING[type(AutoConfig.for_model(family))]
    init = {k: v for k, v in settings.items() if k.endswith("_token") or k in ("add_bos_token", "add_eos_token")}
    tok = cls(vocab=vocab, merges=merges, **init)  # the post-processor as the settings say (BOS for Llama)
    tok.backend_tokenizer.add_special_tokens(specials)
    tok.save_pretrained(str(d))
    (d / "tokenizer_config.json").write_text(json.dumps(settings))


def save_legacy_llama(d: Path) -> None:
    """A Llama-2-style tokenizer: tokenizer.json puts sentencepiece's prefix space in a normalizer (Prepend "▁", then
    spaces as "▁") with BOS from its post-processor; tokenizer_config.json names LlamaTokenizerFast."""
    specials, _, hub = FAMILIES["llama"]
    save_hf_model("llama", d, vocab_size=MODEL_VOCAB)
    vocab, merges = trained_bpe(specials, False)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    config = {**hub, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (d / "tokenizer_config.json").write_text(json.dumps(config))

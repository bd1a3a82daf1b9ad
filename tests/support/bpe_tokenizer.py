"""A small byte-level BPE tokenizer.json trained on a fixed corpus, for tokenizer and chat-template tests."""

from __future__ import annotations

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

CORPUS = ["the quick brown fox jumps over the lazy dog", "a kiln fires clay into pots", "hello world"] * 20


def write_bpe(d) -> RawTokenizer:
    tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    return tok

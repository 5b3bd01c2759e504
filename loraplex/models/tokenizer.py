"""The tiny preset's tokenizer: a byte-level BPE trained in process on a fixed text (deterministic, ~10 ms, offline)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loraplex.models.corpus import TINY_CORPUS

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TINY_VOCAB_SIZE = 512


def train_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes: the 256 byte symbols are always in the vocabulary) with eos/pad specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # One line per "document" so merges never span lines; the order is fixed, so training is deterministic.
    tok.train_from_iterator(TINY_CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)

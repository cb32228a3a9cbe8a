"""Tokenizers: GPT-2 byte-level BPE, BERT WordPiece, SentencePiece, and test tokenizers.

Use ``build_tokenizer(data_config, tensor_model_parallel_size)``; every tokenizer
implements ``MegatronTokenizer``.
"""
from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    CharTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)

__all__ = [
    "MegatronTokenizer",
    "GPT2BPETokenizer",
    "BertWordPieceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
    "CharTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "vocab_size_with_padding",
]

"""Datasets: memory-mapped ``.bin``/``.idx`` token files, GPT samples, blending, samplers.

Names are imported lazily so that light users (``tools/preprocess_data.py`` only needs
``indexed_dataset``) do not pay for importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetBuilder": "indexed_dataset",
    "best_fitting_dtype": "indexed_dataset",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "build_train_valid_test_datasets": "gpt_dataset",
    "BlendableDataset": "blendable_dataset",
    "MegatronPretrainingSampler": "samplers",
    "build_pretraining_data_loader": "samplers",
    "parse_split": "dataset_utils",
    "BertDataset": "bert_dataset",
    "MockBertDataset": "bert_dataset",
    "BertVocabInfo": "bert_dataset",
    "MaskingConfig": "bert_dataset",
    "build_training_sample": "bert_dataset",
    "split_sentences": "sentence_split",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

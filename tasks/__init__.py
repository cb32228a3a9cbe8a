"""Downstream tasks: GLUE MNLI, RACE (finetuning BERT) and zero-shot GPT evaluation (WikiText-103 perplexity, LAMBADA accuracy)."""

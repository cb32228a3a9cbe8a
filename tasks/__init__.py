"""Downstream tasks: GLUE MNLI, RACE (finetuning BERT) and zero-shot GPT perplexity."""

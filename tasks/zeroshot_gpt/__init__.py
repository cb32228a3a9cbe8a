"""Zero-shot evaluation of GPT (WikiText-103 perplexity, LAMBADA last-word accuracy)."""

"""Megatron-style GPT/BERT trainer with PipeDream-2BW pipeline schedules."""
__version__ = "0.1.0"

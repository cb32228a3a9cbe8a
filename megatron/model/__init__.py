"""GPT (and later BERT) models built from tensor-parallel layers."""
from megatron.model.gpt_model import GPTModel
from megatron.model.utils import get_attention_mask, stage_layer_numbers

__all__ = ["GPTModel", "get_attention_mask", "stage_layer_numbers"]

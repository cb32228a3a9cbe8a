"""GPT and BERT models built from tensor-parallel layers."""
from megatron.model.bert_model import BertModel
from megatron.model.flops import gpt_flops_per_iteration
from megatron.model.gpt_model import GPTModel
from megatron.model.language_model import Embedding
from megatron.model.transformer import ParallelTransformer, ParallelTransformerLayer
from megatron.model.utils import get_attention_mask, stage_layer_numbers

__all__ = ["GPTModel", "BertModel", "Embedding", "ParallelTransformer", "ParallelTransformerLayer",
           "get_attention_mask", "stage_layer_numbers", "gpt_flops_per_iteration"]

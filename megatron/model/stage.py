"""What the pipeline executor needs from a model stage, shared by GPT and BERT."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from megatron.model.transformer import sequence_parallel
from megatron.tensor_parallel import TPInfo


class PipelineStage(nn.Module):
    """Base of GPT/BERT stages: the input seam and the tied-embedding accessor.

    Subclasses set ``config``, ``pre_process``, ``embedding`` (first stage) and
    ``output_word_embeddings`` (the last stage's copy of the tied weight, or None).
    """

    input_tensor: Optional[torch.Tensor] = None
    share_embeddings_and_output_weights: bool = True
    tp: TPInfo = TPInfo.single()

    def set_input_tensor(self, tensor: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> None:
        """Input of a non-first stage: the previous stage's [s, b, h] output."""
        if isinstance(tensor, (list, tuple)):
            if len(tensor) != 1:
                raise ValueError(f"{type(self).__name__}.set_input_tensor expects one tensor, "
                                 f"got {len(tensor)}")
            tensor = tensor[0]
        self.input_tensor = tensor

    def stage_input_shape(self, micro_batch_size: int) -> Tuple[int, int, int]:
        """Shape of the activation a non-first stage receives: [s, b, h], or this
        tensor rank's [s/t, b, h] with sequence parallelism.  Its dtype is
        ``config.residual_dtype`` (float32 with --fp32-residual-connection), not
        necessarily the weights'."""
        seq = self.config.seq_length
        if sequence_parallel(self.config, self.tp):
            seq //= self.tp.size
        return (seq, micro_batch_size, self.config.hidden_size)

    def shared_embedding_weight(self) -> Optional[nn.Parameter]:
        """The tied word-embedding parameter this stage holds (first stage, or the last
        stage's copy), or None."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if getattr(self, "output_word_embeddings", None) is not None:
            return self.output_word_embeddings.weight
        return None

#!/usr/bin/env bash
# Zero-shot LAMBADA accuracy of a GPT checkpoint, as Megatron-LM's tasks/main.py reports
# it: the last token of each passage (or, with STRICT=1, its whole last word) predicted
# greedily from the text before it.
#   TEST_FILE  LAMBADA's test set as JSON lines, one {"text": "..."} per passage
#              (default lambada_test.jsonl)
#   LOAD       a checkpoint directory of pretrain_gpt.py (any tensor/pipeline layout)
#   VOCAB, MERGES  GPT-2 BPE files (e.g. ../shared/data/gpt2/encoder.json and vocab.bpe)
#   SIZE       cpu (default: the model of examples/pretrain_gpt_cpu_demo.sh with its
#              SentencePiece tokenizer, TOKENIZER_MODEL) or 355m (GPT-355M, 8 GPUs)
#   STRICT     1: --strict-lambada (the whole last word must be predicted)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST_FILE=${TEST_FILE:-lambada_test.jsonl}
SIZE=${SIZE:-cpu}
STRICT_ARGS=(); [ "${STRICT:-0}" = 1 ] && STRICT_ARGS=(--strict-lambada)
if [ "$SIZE" = 355m ]; then
  LOAD=${LOAD:-checkpoints/gpt_355m}
  LAUNCH=(torchrun --standalone --nproc-per-node 8)
  MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
         --max-position-embeddings 512 --fp16 --pipeline-model-parallel-size 4
         --micro-batch-size 8 --global-batch-size 64
         --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB:-gpt2-vocab.json}"
         --merge-file "${MERGES:-gpt2-merges.txt}")
else
  LOAD=${LOAD:-demo/checkpoints}
  LAUNCH=(env OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2)
  MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
         --max-position-embeddings 128 --pipeline-model-parallel-size 2
         --micro-batch-size 4 --global-batch-size 8 --num-workers 0
         --tokenizer-type SentencePieceTokenizer
         --tokenizer-model "${TOKENIZER_MODEL:-demo/tokenizer.model}")
fi
"${LAUNCH[@]}" tasks/main.py --task LAMBADA --valid-data "$TEST_FILE" --load "$LOAD" \
    "${MODEL[@]}" ${STRICT_ARGS[@]+"${STRICT_ARGS[@]}"}

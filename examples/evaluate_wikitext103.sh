#!/usr/bin/env bash
# Zero-shot WikiText-103 test perplexity of a GPT checkpoint (token-level and the
# word-level adjusted perplexity, as Megatron reports them).
#   TEST_FILE  WikiText-103's wiki.test.tokens (default wikitext-103/wiki.test.tokens).
#              The repository's test data has the same test articles in WikiText-2 form:
#              TEST_FILE=../shared/data/wikitext/wikitext-2-raw/wiki.test.raw
#   LOAD       a checkpoint directory of pretrain_gpt.py (any tensor/pipeline layout)
#   VOCAB, MERGES  GPT-2 BPE files (e.g. ../shared/data/gpt2/encoder.json and vocab.bpe)
#   SIZE       cpu (default: the model of examples/pretrain_gpt_cpu_demo.sh with its
#              SentencePiece tokenizer, TOKENIZER_MODEL) or 355m (GPT-355M, 8 GPUs)
#   STRIDE     --overlapping-eval: sliding-window stride (default: non-overlapping)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST_FILE=${TEST_FILE:-wikitext-103/wiki.test.tokens}
SIZE=${SIZE:-cpu}
STRIDE_ARGS=(); [ -n "${STRIDE:-}" ] && STRIDE_ARGS=(--overlapping-eval "$STRIDE")
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
"${LAUNCH[@]}" tasks/main.py --task WIKITEXT103 --valid-data "$TEST_FILE" --load "$LOAD" \
    "${MODEL[@]}" ${STRIDE_ARGS[@]+"${STRIDE_ARGS[@]}"}

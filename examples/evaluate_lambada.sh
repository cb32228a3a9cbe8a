#!/usr/bin/env bash
# Zero-shot LAMBADA accuracy of a GPT checkpoint, as Megatron-LM's tasks/main.py reports
# it: the last token of each passage (or, with STRICT=1, its whole last word) predicted
# greedily from the text before it.
#   TEST_FILE  LAMBADA's test set as JSON lines, one {"text": "..."} per passage
#              (default lambada_test.jsonl)
#   SIZE       cpu (default: the model of examples/pretrain_gpt_cpu_demo.sh, 2 gloo ranks)
#              or 355m (GPT-355M with the GPT-2 BPE tokenizer, 8 GPUs, fp16)
#   LOAD       a checkpoint directory of pretrain_gpt.py (any tensor/pipeline layout);
#              default $DEMO_DIR/checkpoints (cpu) or checkpoints/gpt_355m (355m)
#   DEMO_DIR   (cpu) the demo's output folder, as in pretrain_gpt_cpu_demo.sh (default demo)
#   TOKENIZER_MODEL  (cpu) the demo's SentencePiece model (default $DEMO_DIR/tokenizer.model)
#   BLOCK      (cpu) gpt2 (default) or llama: the BLOCK the demo checkpoint was trained with
#   VOCAB, MERGES  (355m) GPT-2 BPE files (e.g. ../shared/data/gpt2/encoder.json, vocab.bpe)
#   STRICT     1: --strict-lambada (the whole last word must be predicted)
# Relative paths are taken from the repository root (the script runs there).
# It prints "validation results on LAMBADA | number correct: ... | avg accuracy: ...".
#
#   bash examples/pretrain_gpt_cpu_demo.sh          # writes demo/checkpoints
#   TEST_FILE=lambada_test.jsonl bash examples/evaluate_lambada.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TEST_FILE=${TEST_FILE:-lambada_test.jsonl}
SIZE=${SIZE:-cpu}
STRICT_ARGS=(); [ "${STRICT:-0}" = 1 ] && STRICT_ARGS=(--strict-lambada)
case "$SIZE" in cpu|355m) ;; *) echo "error: SIZE=$SIZE: expected cpu or 355m" >&2; exit 2 ;; esac
if [ "$SIZE" = 355m ]; then
  LOAD=${LOAD:-checkpoints/gpt_355m}
  LAUNCH=(torchrun --standalone --nproc-per-node 8)
  MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
         --max-position-embeddings 512 --fp16 --pipeline-model-parallel-size 4
         --micro-batch-size 8 --global-batch-size 64
         --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB:-gpt2-vocab.json}"
         --merge-file "${MERGES:-gpt2-merges.txt}")
else
  DEMO_DIR=${DEMO_DIR:-demo}
  LOAD=${LOAD:-$DEMO_DIR/checkpoints}
  source examples/demo_block_flags.sh  # BLOCK_FLAGS, as the demo trained with
  LAUNCH=(env OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2)
  MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
         --max-position-embeddings 128 --pipeline-model-parallel-size 2
         --micro-batch-size 4 --global-batch-size 8 --num-workers 0
         --tokenizer-type SentencePieceTokenizer
         --tokenizer-model "${TOKENIZER_MODEL:-$DEMO_DIR/tokenizer.model}"
         ${BLOCK_FLAGS[@]+"${BLOCK_FLAGS[@]}"})
fi
"${LAUNCH[@]}" tasks/main.py --task LAMBADA --valid-data "$TEST_FILE" --load "$LOAD" \
    "${MODEL[@]}" ${STRICT_ARGS[@]+"${STRICT_ARGS[@]}"}

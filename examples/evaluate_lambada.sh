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
TEST_FILE=${TEST_FILE:-lambada_test.jsonl}
STRICT_ARGS=(); [ "${STRICT:-0}" = 1 ] && STRICT_ARGS=(--strict-lambada)
source examples/zeroshot_model.sh  # LOAD, LAUNCH, MODEL
"${LAUNCH[@]}" tasks/main.py --task LAMBADA --valid-data "$TEST_FILE" --load "$LOAD" \
    "${MODEL[@]}" ${STRICT_ARGS[@]+"${STRICT_ARGS[@]}"}

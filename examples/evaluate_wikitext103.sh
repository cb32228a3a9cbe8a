#!/usr/bin/env bash
# Zero-shot WikiText-103 test perplexity of a GPT checkpoint (token-level and the
# word-level adjusted perplexity, as Megatron reports them).
#   TEST_FILE  WikiText-103's wiki.test.tokens (default wikitext-103/wiki.test.tokens).
#              The repository's test data has the same test articles in WikiText-2 form:
#              TEST_FILE=../shared/data/wikitext/wikitext-2-raw/wiki.test.raw
#   SIZE       cpu (default: the model of examples/pretrain_gpt_cpu_demo.sh, 2 gloo ranks)
#              or 355m (GPT-355M with the GPT-2 BPE tokenizer, 8 GPUs, fp16)
#   LOAD       a checkpoint directory of pretrain_gpt.py (any tensor/pipeline layout);
#              default $DEMO_DIR/checkpoints (cpu) or checkpoints/gpt_355m (355m)
#   DEMO_DIR   (cpu) the demo's output folder, as in pretrain_gpt_cpu_demo.sh (default demo)
#   TOKENIZER_MODEL  (cpu) the demo's SentencePiece model (default $DEMO_DIR/tokenizer.model)
#   BLOCK      (cpu) gpt2 (default) or llama: the BLOCK the demo checkpoint was trained with
#   VOCAB, MERGES  (355m) GPT-2 BPE files (e.g. ../shared/data/gpt2/encoder.json, vocab.bpe)
#   STRIDE     --overlapping-eval: sliding-window stride (default: non-overlapping)
# Relative paths are taken from the repository root (the script runs there).
# It prints "validation results on WIKITEXT103 | avg loss: ... | ppl: ... | adjusted ppl: ...".
#
#   bash examples/pretrain_gpt_cpu_demo.sh          # writes demo/checkpoints
#   TEST_FILE=../shared/data/wikitext/wikitext-2-raw/wiki.test.raw \
#       bash examples/evaluate_wikitext103.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TEST_FILE=${TEST_FILE:-wikitext-103/wiki.test.tokens}
STRIDE_ARGS=(); [ -n "${STRIDE:-}" ] && STRIDE_ARGS=(--overlapping-eval "$STRIDE")
source examples/zeroshot_model.sh  # LOAD, LAUNCH, MODEL
"${LAUNCH[@]}" tasks/main.py --task WIKITEXT103 --valid-data "$TEST_FILE" --load "$LOAD" \
    "${MODEL[@]}" ${STRIDE_ARGS[@]+"${STRIDE_ARGS[@]}"}

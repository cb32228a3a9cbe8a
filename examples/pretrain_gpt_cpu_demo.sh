#!/usr/bin/env bash
# The README's main job: set up, build a corpus offline, train a tokenizer, preprocess,
# then pretrain a small GPT with PipeDream-2BW on 4 CPU ranks (gloo):
# 2 pipeline stages (d=2) x 2 parallel pipelines (w=2), m=4 microbatches per batch.
#
#   bash examples/pretrain_gpt_cpu_demo.sh            # everything, about 2 minutes on 2 cores
#   TRAIN_ITERS=50 bash examples/pretrain_gpt_cpu_demo.sh
#   BLOCK=llama bash examples/pretrain_gpt_cpu_demo.sh  # Llama's block: RMSNorm, RoPE,
#                                                       # SwiGLU, GQA, no biases, untied
set -euo pipefail
cd "$(dirname "$0")/.."
# BLOCK_FLAGS; a mistyped BLOCK stops here, before the set-up and before the previous
# run's checkpoints are removed
source examples/demo_block_flags.sh
PY=${PYTHON:-python3}
bash scripts/setup_env.sh
OUT=${DEMO_DIR:-demo}
ITERS=${TRAIN_ITERS:-200}
mkdir -p "$OUT"

if [ ! -s "$OUT/corpus.jsonl" ]; then
  echo "[demo] building a corpus from the documentation strings of Python's standard library"
  $PY tools/make_demo_corpus.py --output "$OUT/corpus.jsonl"
fi
if [ ! -s "$OUT/tokenizer.model" ]; then
  echo "[demo] training a SentencePiece tokenizer (vocab 4096)"
  $PY tools/train_tokenizer.py --input "$OUT/corpus.jsonl" --json-keys text --vocab-size 4096 \
      --model-type bpe --output-prefix "$OUT/tokenizer"
fi
if [ ! -s "$OUT/corpus_text_document.idx" ]; then
  echo "[demo] tokenizing into an indexed dataset"
  $PY tools/preprocess_data.py --input "$OUT/corpus.jsonl" --json-keys text \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
      --append-eod --workers 2 --output-prefix "$OUT/corpus"
fi

if [ -e "$OUT/checkpoints" ]; then
  # a fresh run refuses a --save directory holding another run's checkpoints
  echo "[demo] removing the checkpoints of the previous demo run ($OUT/checkpoints)"
  rm -rf "$OUT/checkpoints"
fi
echo "[demo] pretraining GPT (${BLOCK:-gpt2} block): 4 ranks, --pipeline-schedule 2bw, d=2, w=2"
OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 32 \
    --pipeline-model-parallel-size 2 --pipeline-schedule 2bw \
    --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters $(( ITERS / 10 )) \
    --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$OUT/corpus_text_document" --split 949,50,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$OUT/tokenizer.model" \
    --log-interval 10 --eval-interval 100 --eval-iters 5 --num-workers 0 \
    --save "$OUT/checkpoints" --save-interval "$ITERS" \
    --timeline-file "$OUT/timeline.json" \
    --distributed-timeout-minutes 5 ${BLOCK_FLAGS[@]+"${BLOCK_FLAGS[@]}"}
echo "[demo] done: checkpoints in $OUT/checkpoints, traces in $OUT/timeline_rank*.json"
echo "[demo] sample text from it: $PY tools/generate_samples_gpt.py --load $OUT/checkpoints --prompt 'The module' --top-p 0.9"
echo "[demo] draw three batches of the pipeline: $PY tools/draw_timeline.py --trace '$OUT/timeline_rank*.json' --trace-batches $(( ITERS / 2 )):$(( ITERS / 2 + 3 )) --output $OUT/timeline.png"

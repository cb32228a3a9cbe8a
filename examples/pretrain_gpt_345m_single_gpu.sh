#!/usr/bin/env bash
# GPT-345M (24 layers, hidden 1024, 16 heads) on one GPU, bf16 (PRECISION=fp16 on V100).
# Data: preprocess your corpus first, e.g.
#   python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
#     --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt \
#     --append-eod --workers 16 --output-prefix my-gpt2
# then DATA=my-gpt2_text_document VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt \
#     bash examples/pretrain_gpt_345m_single_gpu.sh
# CKPT is --save and --load: a rerun resumes from its latest checkpoint.
# Relative paths are taken from the repository root (the script runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
PRECISION=${PRECISION:-bf16}
case "$PRECISION" in bf16|fp16) ;; *) echo "error: PRECISION=$PRECISION: expected bf16 or fp16" >&2; exit 2 ;; esac
DATA=${DATA:-my-gpt2_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
CKPT=${CKPT:-checkpoints/gpt2_345m}
torchrun --standalone --nproc-per-node 1 pretrain_gpt.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 \
    --micro-batch-size 8 --global-batch-size 512 \
    --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5 --lr-decay-style cosine \
    --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 1e-2 --clip-grad 1.0 \
    --"$PRECISION" \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10 \
    --save "$CKPT" --load "$CKPT"

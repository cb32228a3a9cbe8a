#!/usr/bin/env bash
# BERT-355M (24 layers, hidden 1024, 16 heads, sequence 512) pretraining on AWS
# p3.16xlarge servers (8 x V100 16 GB each) with PipeDream-2BW and Adam, the paper's
# §5.1 setting: global batch 1024, lr 1e-4 with warmup then linear decay, fp16.
# Run on every server (NODE_RANK=0..NNODES-1, MASTER_ADDR = server 0):
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=10.0.0.1 DATA=wiki_text_sentence \
#       VOCAB=bert-large-uncased-vocab.txt bash examples/pretrain_bert_p3_16xlarge.sh
# DATA is a sentence-level dataset:
#   python tools/preprocess_data.py --input wiki.jsonl --split-sentences \
#       --tokenizer-type BertWordPieceLowerCase --vocab-file $VOCAB --output-prefix wiki
# Check the layout with the planner first, e.g.
#   python tools/plan.py --model bert-355m --cluster p3.16xlarge --num-gpus 64 --max-batch-size 1024
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
DATA=${DATA:-wiki_text_sentence}
VOCAB=${VOCAB:-bert-large-uncased-vocab.txt}
PP=${PP:-4}
MBS=${MBS:-8}
SCHEDULE=${SCHEDULE:-2bw}
SAVE=${SAVE:-checkpoints/bert_355m}
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node 8 \
    --master-addr "$MASTER_ADDR" --master-port 6000 pretrain_bert.py \
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size "$MBS" --global-batch-size 1024 \
    --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE" \
    --train-iters 100000 --optimizer adam --lr 1e-4 --min-lr 1e-5 \
    --lr-decay-style linear --lr-warmup-fraction 0.01 \
    --weight-decay 1e-2 --clip-grad 1.0 --fp16 \
    --mask-prob 0.15 --short-seq-prob 0.1 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --load "$SAVE" --save-interval 5000 --distributed-timeout-minutes 20

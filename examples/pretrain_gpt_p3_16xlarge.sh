#!/usr/bin/env bash
# GPT on AWS p3.16xlarge servers (8 x V100 16 GB each, NVLink inside a server,
# 25 Gbit/s between servers) with PipeDream-2BW, as in the paper's §5.
# Run on every server (NODE_RANK=0..NNODES-1, MASTER_ADDR = server 0):
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=10.0.0.1 bash examples/pretrain_gpt_p3_16xlarge.sh
# The default is the paper's GPT 2.2B-class model on 64 GPUs: d=8 stages (one per
# GPU of a server would put pipeline traffic on NVLink; ranks are ordered tensor-fastest,
# then data, then pipeline, so with w=8, d=8 each server holds the 8 replicas of one
# stage and their all-reduce stays on NVLink while activations cross servers).
# Ask the planner for your own model and cluster:
#   python tools/plan.py --model gpt-2.2b --cluster p3.16xlarge --num-gpus 64 --max-batch-size 512
# DATA (an indexed dataset prefix, see examples/pretrain_gpt_345m_single_gpu.sh), VOCAB,
# MERGES, PP, SCHEDULE and SAVE (--save and --load: a rerun resumes) may be set.
# Relative paths are taken from the repository root (the script runs there).
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
DATA=${DATA:-my-gpt2_text_document}
VOCAB=${VOCAB:-gpt2-vocab.json}
MERGES=${MERGES:-gpt2-merges.txt}
PP=${PP:-8}
SCHEDULE=${SCHEDULE:-2bw}
SAVE=${SAVE:-checkpoints/gpt_p3}
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node 8 \
    --master-addr "$MASTER_ADDR" --master-port 6000 pretrain_gpt.py \
    --num-layers 40 --hidden-size 2048 --num-attention-heads 32 \
    --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 1 --global-batch-size 512 \
    --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE" \
    --train-iters 100000 --lr 1e-4 --lr-decay-style linear --lr-warmup-fraction 0.01 \
    --weight-decay 1e-2 --clip-grad 1.0 --fp16 \
    --data-path "$DATA" --split 949,50,1 \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB" --merge-file "$MERGES" \
    --log-interval 10 --eval-interval 1000 --eval-iters 10 \
    --save "$SAVE" --load "$SAVE" --save-interval 5000 --distributed-timeout-minutes 20

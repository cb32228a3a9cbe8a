#!/usr/bin/env bash
# Finetune a pretrained BERT on GLUE MNLI; accuracy on dev_matched and dev_mismatched
# after every epoch.
#   MNLI_DIR   GLUE's MNLI folder (train.tsv, dev_matched.tsv, dev_mismatched.tsv);
#              default glue_data/MNLI.  The repository's test data has small samples:
#              MNLI_DIR=../shared/data/glue/MNLI
#   PRETRAINED a checkpoint directory of pretrain_bert.py (any tensor/pipeline layout)
#   VOCAB      the BERT vocab.txt used for pretraining
#   SIZE       cpu (default: the model of examples/pretrain_bert_cpu.sh, 2 gloo ranks)
#              or 355m (the paper's BERT-355M on one p3.16xlarge: 8 GPUs, fp16)
#
#   VOCAB=../shared/data/bert/vocab.txt MNLI_DIR=../shared/data/glue/MNLI \
#       EPOCHS=1 GLOBAL_BATCH=4 bash examples/finetune_mnli.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MNLI_DIR=${MNLI_DIR:-glue_data/MNLI}
VOCAB=${VOCAB:-bert-large-uncased-vocab.txt}
SIZE=${SIZE:-cpu}
EPOCHS=${EPOCHS:-3}
SCHEDULE=${SCHEDULE:-2bw}
if [ "$SIZE" = 355m ]; then
  PRETRAINED=${PRETRAINED:-checkpoints/bert_355m}
  LAUNCH=(torchrun --standalone --nproc-per-node 8)
  MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
         --max-position-embeddings 512 --fp16 --pipeline-model-parallel-size 4
         --micro-batch-size 8 --global-batch-size "${GLOBAL_BATCH:-128}" --lr 1e-5)
else
  PRETRAINED=${PRETRAINED:-checkpoints/bert_cpu}
  LAUNCH=(env OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2)
  MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
         --max-position-embeddings 128 --pipeline-model-parallel-size 2
         --micro-batch-size 2 --global-batch-size "${GLOBAL_BATCH:-16}" --lr 5e-5
         --num-workers 0)
fi
"${LAUNCH[@]}" tasks/main.py --task MNLI \
    --train-data "$MNLI_DIR/train.tsv" \
    --valid-data "$MNLI_DIR/dev_matched.tsv" "$MNLI_DIR/dev_mismatched.tsv" \
    --pretrained-checkpoint "$PRETRAINED" --epochs "$EPOCHS" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    "${MODEL[@]}" --pipeline-schedule "$SCHEDULE" \
    --lr-decay-style linear --lr-warmup-fraction 0.065 --weight-decay 1e-2 --clip-grad 1.0 \
    --log-interval 10 --save "${SAVE:-checkpoints/mnli_$SIZE}"

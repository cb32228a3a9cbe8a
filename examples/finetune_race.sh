#!/usr/bin/env bash
# Finetune a pretrained BERT on RACE (4-way multiple choice); accuracy on each
# validation directory after every epoch.
#   RACE_DIR   the RACE release (train/, dev/, test/ with high/ and middle/); default RACE.
#              The repository's test data has dev and test passages only:
#              RACE_DIR=../shared/data/race TRAIN="dev/middle" VALID="test/middle test/high"
#   PRETRAINED a checkpoint directory of pretrain_bert.py (any tensor/pipeline layout)
#   VOCAB      the BERT vocab.txt used for pretraining
#   SIZE       cpu (default, 2 gloo ranks) or 355m (BERT-355M, one p3.16xlarge, fp16)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RACE_DIR=${RACE_DIR:-RACE}
TRAIN=${TRAIN:-train/middle train/high}
VALID=${VALID:-dev/middle dev/high}
VOCAB=${VOCAB:-bert-large-uncased-vocab.txt}
SIZE=${SIZE:-cpu}
EPOCHS=${EPOCHS:-3}
SCHEDULE=${SCHEDULE:-2bw}
train_dirs=(); for d in $TRAIN; do train_dirs+=("$RACE_DIR/$d"); done
valid_dirs=(); for d in $VALID; do valid_dirs+=("$RACE_DIR/$d"); done
if [ "$SIZE" = 355m ]; then
  PRETRAINED=${PRETRAINED:-checkpoints/bert_355m}
  LAUNCH=(torchrun --standalone --nproc-per-node 8)
  MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
         --max-position-embeddings 512 --fp16 --pipeline-model-parallel-size 4
         --micro-batch-size 4 --global-batch-size "${GLOBAL_BATCH:-32}" --lr 1e-5)
else
  PRETRAINED=${PRETRAINED:-checkpoints/bert_cpu}
  LAUNCH=(env OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2)
  MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
         --max-position-embeddings 128 --pipeline-model-parallel-size 2
         --micro-batch-size 2 --global-batch-size "${GLOBAL_BATCH:-8}" --lr 5e-5
         --num-workers 0)
fi
"${LAUNCH[@]}" tasks/main.py --task RACE \
    --train-data "${train_dirs[@]}" --valid-data "${valid_dirs[@]}" \
    --pretrained-checkpoint "$PRETRAINED" --epochs "$EPOCHS" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    "${MODEL[@]}" --pipeline-schedule "$SCHEDULE" \
    --lr-decay-style linear --lr-warmup-fraction 0.06 --weight-decay 1e-2 --clip-grad 1.0 \
    --log-interval 10 --save "${SAVE:-checkpoints/race_$SIZE}"

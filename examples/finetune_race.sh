#!/usr/bin/env bash
# Finetune a pretrained BERT on RACE (4-way multiple choice); accuracy on each
# validation directory after every epoch.
#   RACE_DIR   the RACE release (train/, dev/, test/ with high/ and middle/); default RACE.
#              The repository's test data has dev and test passages only:
#              RACE_DIR=../shared/data/race TRAIN="dev/middle" VALID="test/middle test/high"
#   PRETRAINED a checkpoint directory of pretrain_bert.py (any tensor/pipeline layout);
#              default checkpoints/bert_cpu (what examples/pretrain_bert_cpu.sh saves)
#              or checkpoints/bert_355m (SIZE=355m)
#   VOCAB      the BERT vocab.txt used for pretraining
#   SIZE       cpu (default: the model of examples/pretrain_bert_cpu.sh, 2 gloo ranks)
#              or 355m (BERT-355M, one p3.16xlarge: 8 GPUs, fp16)
#   EPOCHS     default 3; GLOBAL_BATCH default 8 (cpu) or 32 (355m)
#   SCHEDULE   --pipeline-schedule (default 2bw)
#   SAVE       where the finetuned checkpoint goes (default checkpoints/race_$SIZE).
#              A finetuned model is never overwritten: the trainer refuses a SAVE that
#              already holds checkpoints, so a rerun needs another SAVE (or the old one
#              removed by hand).
# Relative paths are taken from the repository root (the script runs there).
#
#   VOCAB=../shared/data/bert/vocab.txt bash examples/pretrain_bert_cpu.sh  # checkpoints/bert_cpu
#   VOCAB=../shared/data/bert/vocab.txt RACE_DIR=../shared/data/race TRAIN="dev/middle" \
#       VALID="test/middle test/high" EPOCHS=1 bash examples/finetune_race.sh
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
case "$SIZE" in cpu|355m) ;; *) echo "error: SIZE=$SIZE: expected cpu or 355m" >&2; exit 2 ;; esac
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
SAVE=${SAVE:-checkpoints/race_$SIZE}
"${LAUNCH[@]}" tasks/main.py --task RACE \
    --train-data "${train_dirs[@]}" --valid-data "${valid_dirs[@]}" \
    --pretrained-checkpoint "$PRETRAINED" --epochs "$EPOCHS" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    "${MODEL[@]}" --pipeline-schedule "$SCHEDULE" \
    --lr-decay-style linear --lr-warmup-fraction 0.06 --weight-decay 1e-2 --clip-grad 1.0 \
    --log-interval 10 --save "$SAVE"

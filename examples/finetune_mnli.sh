#!/usr/bin/env bash
# Finetune a pretrained BERT on GLUE MNLI; accuracy on dev_matched and dev_mismatched
# after every epoch.
#   MNLI_DIR   GLUE's MNLI folder (train.tsv, dev_matched.tsv, dev_mismatched.tsv);
#              default glue_data/MNLI.  The repository's test data has small samples:
#              MNLI_DIR=../shared/data/glue/MNLI
#   PRETRAINED a checkpoint directory of pretrain_bert.py (any tensor/pipeline layout);
#              default checkpoints/bert_cpu (what examples/pretrain_bert_cpu.sh saves)
#              or checkpoints/bert_355m (SIZE=355m)
#   VOCAB      the BERT vocab.txt used for pretraining
#   SIZE       cpu (default: the model of examples/pretrain_bert_cpu.sh, 2 gloo ranks)
#              or 355m (the paper's BERT-355M on one p3.16xlarge: 8 GPUs, fp16)
#   EPOCHS     default 3; GLOBAL_BATCH default 16 (cpu) or 128 (355m): the sample's
#              train.tsv holds 6 examples, so GLOBAL_BATCH=4 (one iteration an epoch)
#   SCHEDULE   --pipeline-schedule (default 2bw)
#   SAVE       where the finetuned checkpoint goes (default checkpoints/mnli_$SIZE).
#              A finetuned model is never overwritten: the trainer refuses a SAVE that
#              already holds checkpoints, so a rerun needs another SAVE (or the old one
#              removed by hand).
# Relative paths are taken from the repository root (the script runs there).
#
#   VOCAB=../shared/data/bert/vocab.txt bash examples/pretrain_bert_cpu.sh  # checkpoints/bert_cpu
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
case "$SIZE" in cpu|355m) ;; *) echo "error: SIZE=$SIZE: expected cpu or 355m" >&2; exit 2 ;; esac
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
SAVE=${SAVE:-checkpoints/mnli_$SIZE}
"${LAUNCH[@]}" tasks/main.py --task MNLI \
    --train-data "$MNLI_DIR/train.tsv" \
    --valid-data "$MNLI_DIR/dev_matched.tsv" "$MNLI_DIR/dev_mismatched.tsv" \
    --pretrained-checkpoint "$PRETRAINED" --epochs "$EPOCHS" \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" \
    "${MODEL[@]}" --pipeline-schedule "$SCHEDULE" \
    --lr-decay-style linear --lr-warmup-fraction 0.065 --weight-decay 1e-2 --clip-grad 1.0 \
    --log-interval 10 --save "$SAVE"

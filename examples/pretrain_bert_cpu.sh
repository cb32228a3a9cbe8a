#!/usr/bin/env bash
# Pretrain a small BERT on CPU with the gloo backend: 2 ranks, a 2-stage pipeline,
# PipeDream-2BW.  Data, in order of preference:
#   DATA=prefix            an existing sentence-level dataset (prefix.bin/.idx)
#   INPUT=corpus.jsonl     JSON lines {"text": ...}; split into sentences and tokenized here
#   (neither)              synthetic sentence pairs (--mock-data)
# VOCAB is the BERT WordPiece vocabulary (uncased), e.g. bert-large-uncased-vocab.txt;
# the repository's test data has one: VOCAB=../shared/data/bert/vocab.txt
#
#   VOCAB=../shared/data/bert/vocab.txt INPUT=corpus.jsonl bash examples/pretrain_bert_cpu.sh
#   VOCAB=../shared/data/bert/vocab.txt TRAIN_ITERS=20 SCHEDULE=flush \
#       bash examples/pretrain_bert_cpu.sh
# TRAIN_ITERS (default 100), SCHEDULE (--pipeline-schedule, default 2bw), NPROC ranks
# (default 2) and PP pipeline stages (default 2) may be set; OUT (default data/bert_cpu)
# holds the preprocessed INPUT.  Relative paths are taken from the repository root.
# The checkpoint goes to $SAVE (default checkpoints/bert_cpu), which
# examples/finetune_mnli.sh and examples/finetune_race.sh read (their PRETRAINED; any
# NPROC/PP layout).  As in Megatron's scripts, --load names the same directory: a rerun
# resumes from its latest checkpoint, and once TRAIN_ITERS are done it stops with
# "error: nothing to train" and exit status 1 (the checkpoint stays).  A rerun with a
# larger TRAIN_ITERS stops with an error, as Megatron's does: the checkpoint's LR
# schedule decays over the old TRAIN_ITERS (run pretrain_bert.py with the same flags
# plus --override-opt_param-scheduler to take the new length).  INPUT is preprocessed
# again when it (or VOCAB) is not what $OUT/corpus.source says the dataset came from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VOCAB=${VOCAB:-bert-large-uncased-vocab.txt}
OUT=${OUT:-data/bert_cpu}
SAVE=${SAVE:-checkpoints/bert_cpu}
ITERS=${TRAIN_ITERS:-100}
SCHEDULE=${SCHEDULE:-2bw}
NPROC=${NPROC:-2}
PP=${PP:-2}
[ -f "$VOCAB" ] || { echo "VOCAB=$VOCAB: no such file (a BERT vocab.txt is needed)" >&2; exit 1; }

DATA_ARGS=(--mock-data)
if [ -n "${DATA:-}" ]; then
  DATA_ARGS=(--data-path "$DATA" --split 949,50,1)
elif [ -n "${INPUT:-}" ]; then
  [ -f "$INPUT" ] || { echo "INPUT=$INPUT: no such file (JSON lines {\"text\": ...})" >&2; exit 1; }
  mkdir -p "$OUT"
  # $OUT/corpus.source names what the dataset was made from (INPUT's path, size and
  # modification time, and VOCAB): another INPUT or VOCAB, or an edited INPUT, is
  # preprocessed again instead of training on the previous corpus
  SOURCE="$(cd "$(dirname "$INPUT")" && pwd)/$(basename "$INPUT")"
  SOURCE="$SOURCE $(stat -c '%s %Y' "$INPUT" 2>/dev/null || stat -f '%z %m' "$INPUT") $VOCAB"
  if [ ! -s "$OUT/corpus_text_sentence.idx" ] || \
     [ "$(cat "$OUT/corpus.source" 2>/dev/null)" != "$SOURCE" ]; then
    echo "[bert] splitting $INPUT into sentences and tokenizing"
    $PY tools/preprocess_data.py --input "$INPUT" --json-keys text --split-sentences \
        --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" --workers 2 \
        --output-prefix "$OUT/corpus"
    echo "$SOURCE" > "$OUT/corpus.source"
  fi
  DATA_ARGS=(--data-path "$OUT/corpus_text_sentence" --split 949,50,1)
fi

OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    pretrain_bert.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 16 \
    --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE" \
    --train-iters "$ITERS" --lr 1e-4 --lr-decay-style linear --lr-warmup-fraction 0.01 \
    --weight-decay 1e-2 --clip-grad 1.0 \
    --mask-prob 0.15 --short-seq-prob 0.1 \
    --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB" "${DATA_ARGS[@]}" \
    --log-interval 10 --eval-interval 50 --eval-iters 2 --num-workers 0 \
    --save "$SAVE" --load "$SAVE" --save-interval "$ITERS"

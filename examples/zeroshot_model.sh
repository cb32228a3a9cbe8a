# The checkpoint, launcher and model flags of the zero-shot scripts
# (evaluate_wikitext103.sh, evaluate_lambada.sh), sourced by both from the repository
# root: SIZE=cpu (default: the CPU demo's model in DEMO_DIR, default demo, with the BLOCK
# it trained with and its TOKENIZER_MODEL) or 355m (GPT-355M on 8 GPUs, VOCAB and MERGES).
# Sets LOAD (unless given), LAUNCH and MODEL.
PY=${PYTHON:-python3}
SIZE=${SIZE:-cpu}
case "$SIZE" in cpu|355m) ;; *) echo "error: SIZE=$SIZE: expected cpu or 355m" >&2; exit 2 ;; esac
if [ "$SIZE" = 355m ]; then
  LOAD=${LOAD:-checkpoints/gpt_355m}
  LAUNCH=(torchrun --standalone --nproc-per-node 8)
  MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
         --max-position-embeddings 512 --fp16 --pipeline-model-parallel-size 4
         --micro-batch-size 8 --global-batch-size 64
         --tokenizer-type GPT2BPETokenizer --vocab-file "${VOCAB:-gpt2-vocab.json}"
         --merge-file "${MERGES:-gpt2-merges.txt}")
else
  DEMO_DIR=${DEMO_DIR:-demo}
  LOAD=${LOAD:-$DEMO_DIR/checkpoints}
  source examples/demo_block_flags.sh  # BLOCK_FLAGS, as the demo trained with
  LAUNCH=(env OMP_NUM_THREADS=1 $PY -m torch.distributed.run --standalone --nproc-per-node 2)
  MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
         --max-position-embeddings 128 --pipeline-model-parallel-size 2
         --micro-batch-size 4 --global-batch-size 8 --num-workers 0
         --tokenizer-type SentencePieceTokenizer
         --tokenizer-model "${TOKENIZER_MODEL:-$DEMO_DIR/tokenizer.model}"
         ${BLOCK_FLAGS[@]+"${BLOCK_FLAGS[@]}"})
fi

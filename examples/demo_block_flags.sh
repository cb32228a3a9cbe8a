# The transformer block flags of the CPU demo (examples/pretrain_gpt_cpu_demo.sh) for
# BLOCK=gpt2 (default) or llama, in BLOCK_FLAGS; sourced by the demo and by the scripts
# that evaluate its checkpoint (a checkpoint of another block is refused, naming each
# flag that differs).
case "${BLOCK:-gpt2}" in
  gpt2) BLOCK_FLAGS=() ;;
  llama) BLOCK_FLAGS=(--normalization RMSNorm --position-embedding-type rope --swiglu
                      --ffn-hidden-size 352 --group-query-attention --num-query-groups 2
                      --disable-bias-linear --untie-embeddings-and-output-weights) ;;
  *) echo "error: BLOCK=${BLOCK}: expected gpt2 or llama" >&2; exit 2 ;;
esac

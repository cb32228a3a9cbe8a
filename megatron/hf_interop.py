"""Hugging Face ``transformers`` model directories <-> our checkpoints.

Export (``tools/checkpoint_util.py --load CKPT --to-hf DIR``; DIR new or empty, written
as ``DIR.tmp.PID`` and renamed to DIR at the end, so a failed export leaves no DIR):

* GPT -> ``GPT2LMHeadModel``.  Same architecture: learned positions, pre-LayerNorm
  blocks, GELU (exact: ``activation_function: "gelu"``; with ``--openai-gelu`` the tanh
  approximation, ``"gelu_new"``, as OpenAI's GPT-2; with ``--squared-relu``
  ``"relu2"``, transformers' relu(x)^2 -- not ``"relu"``, which does not square),
  final LayerNorm, output tied to the word embedding (or an untied ``lm_head``).  Weight layout differences:
  transformers' GPT-2 uses ``Conv1D`` ([in, out], the transpose of our Linear weights),
  and its fused ``c_attn`` output is [q of all heads | k | v] while ours is ordered
  [head, (q, k, v), head_dim] so that a tensor-parallel split hands out whole heads.
* Llama-style GPT (``--normalization RMSNorm --position-embedding-type rope --swiglu``,
  any ``--num-query-groups``, biases on all four linear layers or on none, tied or
  untied output) -> ``LlamaForCausalLM``; with ``--disable-bias-linear --add-qkv-bias``
  (biases on q, k, v only) -> ``Qwen2ForCausalLM``; with ``--qk-layernorm`` and no
  biases -> ``Qwen3ForCausalLM`` (its ``q_norm``/``k_norm`` are our per-head query and
  key RMSNorms, applied before RoPE in both).  Our fused QKV rows [group, (the group's
  q heads, k, v), head_dim] become ``q_proj``/``k_proj``/``v_proj``; the SwiGLU weight
  [gate; up] becomes ``gate_proj`` and ``up_proj``; ``--kv-channels`` is ``head_dim``.
  RoPE is the same "rotate half" rotation of whole heads; a ``--rotary-percent`` below
  1 is refused (transformers' Llama does not apply ``partial_rotary_factor``).
  ``--rotary-interleaved`` (pairs (2i, 2i+1)) exports by reordering each query and key
  head's dimensions (and their biases and --qk-layernorm weights) to [even ones, odd
  ones], which turns the interleaved rotation into transformers' rotate-half and leaves
  every q.k product unchanged.  ``--rotary-seq-len-interpolation-factor N`` is
  transformers' ``rope_type: "linear"`` with ``factor`` N (its frequencies divided by N,
  the same angles as our positions divided by N); together with ``--use-rope-scaling``
  it is refused (transformers takes one ``rope_type``).
  ``--use-rope-scaling`` is transformers' ``rope_type: "llama3"`` with Llama 3.1's
  constants (all three models compute their frequencies through the same
  ``rope_type`` table); config.json keeps our ``max_position_embeddings`` even where it
  is not above the original 8192, which transformers warns about and which changes
  nothing it computes (the llama3 frequencies do not depend on it), rather than
  claiming a context the model was not built for.
* Any other combination of the Llama-style options has no transformers model and is
  refused with one line naming the flags; so is a BERT built with any of them (or with
  ``--squared-relu``: MegatronBert's ``hidden_act`` also drives its LM head, which ours
  keeps GeLU), so is any model built with ``--apply-residual-connection-post-layernorm``
  (every target takes its residuals before the norm), and so
  is a checkpoint whose recorded model config holds an option this module does not
  know with a value other than its default (``check_known_options``): an export never
  drops what it does not understand.
* BERT -> ``MegatronBertForPreTraining`` (or ``MegatronBertForMaskedLM`` without the
  sentence-order head): our BERT is Megatron's pre-LayerNorm BERT, which transformers
  implements under that name; the original post-LayerNorm ``BertForPreTraining`` is a
  different network, so it is not a target.
* The padding rows of the vocabulary (Megatron pads it to a multiple of
  ``make_vocab_size_divisible_by * t``) are dropped: the exported vocabulary has the
  tokenizer's real size.
* Tokenizer files: GPT-2 BPE -> ``vocab.json`` + ``merges.txt``; BERT WordPiece ->
  ``vocab.txt``; a HuggingFaceTokenizer -> its ``save_pretrained`` files; any other
  tokenizer (NullTokenizer, SentencePiece) writes none and says so.  A GPT's config.json
  bos/eos ids are its tokenizer's (``special_token_ids``: the recorded vocab.json's
  <|endoftext|>, a HuggingFaceTokenizer's own), else null.
* PipeDream-2BW checkpoints: ``model`` (the newest weights) is exported, not the shadow.

This module reads the checkpoint and writes the directory (``export_hf``); the target is
chosen (or refused) by ``megatron.hf_export_target``, the weights and config.json are
mapped per model by ``megatron.hf_export_models`` (through the q/k/v and RoPE layouts of
``megatron.hf_layouts``), the tokenizer files and ids come from
``megatron.hf_tokenizer_files``, and the output directory's checks and final rename from
``megatron.export_output``.

Import (``--from-hf DIR --save OUT``): ``megatron.hf_import``, which reads the
weight layouts this export writes.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, check_true_vocab, read_full_state,
                                         true_vocab_size)
from megatron.errors import CheckpointError, UserError
from megatron.export_output import check_export_path, publish_export, say
from megatron.hf_export_models import bert_to_hf, gpt_to_hf, gpt_to_llama
from megatron.hf_export_target import export_target
from megatron.hf_tokenizer_files import special_token_ids, tokenizer_files


class _ReadNames(dict):
    """A state dict that records the names read from it, so that the export can tell
    whether any tensor was left behind."""

    def __init__(self, full: Dict[str, torch.Tensor]) -> None:
        super().__init__(full)
        self.names: set = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.names.add(name)
        return super().__getitem__(name)


def export_hf(load: str, out_dir: str, *, iteration: Optional[int] = None,
              true_vocab: Optional[int] = None, allow_unsafe: bool = False,
              vocab_flag: Optional[str] = None) -> str:
    """Write checkpoint ``load`` as a transformers model directory ``out_dir`` (new or
    empty).  The files are written into a sibling staging directory that is renamed to
    ``out_dir`` at the end, so a failed or interrupted export leaves no ``out_dir``.
    ``vocab_flag``: the option ``true_vocab`` came from, when a user gave it (it is then
    checked against the checkpoint, ``check_true_vocab``)."""
    from safetensors.torch import save_file

    check_export_path(None, out_dir)
    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    config = state.common.get("config") or {}
    model_cfg = dict(config.get("model") or {})
    if not model_cfg:
        raise CheckpointError(f"--load {load}: the checkpoint records no model config; "
                              f"expected a checkpoint written by this trainer")
    for key in ("hidden_size", "num_attention_heads"):
        if type(model_cfg.get(key)) is not int or model_cfg[key] < 1:
            raise CheckpointError(f"--load {load}: its config records {key} "
                                  f"{model_cfg.get(key)!r}; expected a positive integer")
    if WORD_EMBEDDING not in state.model:
        raise CheckpointError(f"--load {load}: the checkpoint has no {WORD_EMBEDDING}; "
                              f"expected a GPT or BERT checkpoint of this trainer")
    model_cfg.setdefault("num_layers", state.ckpt.num_layers)
    model_cfg.setdefault("ffn_hidden_size", 4 * int(model_cfg["hidden_size"]))
    model_cfg.setdefault("max_position_embeddings", model_cfg.get("seq_length"))
    full = state.model
    is_bert = "lm_head.bias" in full or "embedding.tokentype_embeddings.weight" in full
    target = export_target(model_cfg, full, is_bert)
    padded = full[WORD_EMBEDDING].shape[0]
    if vocab_flag:
        check_true_vocab(true_vocab, padded, config, vocab_flag)
    vocab = true_vocab_size(config, true_vocab)
    if vocab is None or vocab > padded:
        say(f"note: unpadded vocabulary size unknown (pass --true-vocab-size); exporting "
             f"all {padded} rows")
        vocab = padded
    read = _ReadNames(full)
    try:
        to_hf = {"bert": bert_to_hf, "gpt2": gpt_to_hf, "llama": gpt_to_llama}[target]
        tensors, hf_config = to_hf(read, model_cfg, vocab)
    except KeyError as exc:  # a layer or head its config implies is not in the files
        raise CheckpointError(f"--load {load}: the checkpoint has no {exc.args[0]!r}, which "
                              f"its config (num_layers {model_cfg.get('num_layers')!r}) "
                              f"implies") from None
    except (TypeError, ValueError, RuntimeError) as exc:  # config values, head split
        raise CheckpointError(f"--load {load}: its config does not describe its tensors "
                              f"({type(exc).__name__}: {exc})") from None
    left = sorted(set(full) - read.names)
    if left:  # a tensor of an option the record does not show: never dropped silently
        raise CheckpointError(f"--load {load}: the checkpoint holds {left[0]!r}"
                              f"{f' (and {len(left) - 1} more)' if len(left) > 1 else ''}, "
                              f"which its recorded config does not account for; the export "
                              f"would drop it, so it is refused")
    dtype = next(iter(tensors.values())).dtype
    hf_config["torch_dtype"] = str(dtype).replace("torch.", "")
    scaling = hf_config.get("rope_scaling") or {}
    positions = hf_config.get("max_position_embeddings")
    if scaling.get("original_max_position_embeddings", 0) >= (positions or 0) > 0:
        say(f"note: config.json keeps max_position_embeddings {positions} (the model's); "
             f"transformers warns that original_max_position_embeddings "
             f"{scaling['original_max_position_embeddings']} should be below it, which "
             f"changes nothing it computes (the llama3 frequencies do not depend on it)")
    data_cfg = config.get("data") or {}
    if not is_bert:
        # GPT2Config's defaults (50256) are GPT-2's ids, outside a smaller vocabulary
        # (transformers warns on loading): the tokenizer's own ids where known, else null
        hf_config.update({"bos_token_id": None, "eos_token_id": None,
                          **special_token_ids(data_cfg, vocab)})
    check_export_path(None, out_dir)  # again: the checkpoint took a while to read
    # a sibling, so the final rename stays on one file system (atomic)
    staging = f"{os.path.abspath(out_dir)}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(staging), exist_ok=True)
        if os.path.isdir(staging):  # left by a killed export of a process with this pid
            shutil.rmtree(staging)
        os.makedirs(staging)
        save_file({k: v.detach().contiguous() for k, v in tensors.items()},
                  os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w") as fh:
            json.dump(hf_config, fh, indent=2)
        note = tokenizer_files(data_cfg, staging, int(model_cfg["max_position_embeddings"]))
        publish_export(staging, out_dir)
    except OSError as exc:  # unwritable, disk full: nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"--to-hf {out_dir}: cannot write the export "
                        f"({exc.strerror or type(exc).__name__}: "
                        f"{exc.filename or staging})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    say(note)
    return out_dir

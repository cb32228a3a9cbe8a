"""Hugging Face ``transformers`` model directories <-> our checkpoints.

Export (``tools/checkpoint_util.py --load CKPT --to-hf DIR``):

* GPT -> ``GPT2LMHeadModel``.  Same architecture: learned positions, pre-LayerNorm
  blocks, GELU (exact: ``activation_function: "gelu"``; with ``--openai-gelu`` the tanh
  approximation, ``"gelu_new"``, as OpenAI's GPT-2), final LayerNorm, output tied to
  the word embedding (or an untied ``lm_head``).  Weight layout differences:
  transformers' GPT-2 uses ``Conv1D`` ([in, out], the transpose of our Linear weights),
  and its fused ``c_attn`` output is [q of all heads | k | v] while ours is ordered
  [head, (q, k, v), head_dim] so that a tensor-parallel split hands out whole heads.
* BERT -> ``MegatronBertForPreTraining`` (or ``MegatronBertForMaskedLM`` without the
  sentence-order head): our BERT is Megatron's pre-LayerNorm BERT, which transformers
  implements under that name; the original post-LayerNorm ``BertForPreTraining`` is a
  different network, so it is not a target.
* The padding rows of the vocabulary (Megatron pads it to a multiple of
  ``make_vocab_size_divisible_by * t``) are dropped: the exported vocabulary has the
  tokenizer's real size.
* Tokenizer files: GPT-2 BPE -> ``vocab.json`` + ``merges.txt``; BERT WordPiece ->
  ``vocab.txt``; any other tokenizer (NullTokenizer, SentencePiece) writes none and
  says so.

Import (``--from-hf DIR --save OUT``): a GPT-2 directory with ``model.safetensors`` (or a
``pytorch_model.bin``, read with ``torch.load(weights_only=True)``, which refuses
pickled code) becomes an iteration-0 checkpoint of any (t, d) layout, usable with
``--load OUT --finetune`` or ``--load OUT``.  The script prints the model flags the
training run needs.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, CheckpointShards, FullState,
                                         read_full_state, true_vocab_size, write_layout)
from megatron.errors import CheckpointError, UserError

_ATTN = "self_attention.query_key_value"
_GELU_EXACT = ("gelu",)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def _say(line: str) -> None:
    print(f"checkpoint_util.py: {line}", file=sys.stderr)


# ------------------------------------------------------------------- q/k/v layouts
def qkv_ours_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows [head, (q, k, v), head_dim] -> [(q, k, v), head, head_dim] (weight or bias)."""
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def qkv_hf_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    rest = w.shape[1:]
    hd = w.shape[0] // (3 * heads)
    return w.reshape(3, heads, hd, *rest).transpose(0, 1).reshape(3 * heads * hd, *rest)


def _layers(full: Dict[str, torch.Tensor], num_layers: int):
    for i in range(num_layers):
        yield i, (lambda n, i=i: full[f"encoder.layers.{i}.{n}"])


# --------------------------------------------------------------------------- export
def gpt_to_hf(full: Dict[str, torch.Tensor], model_cfg: Dict[str, Any], vocab: int
              ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our full GPT state dict -> (GPT2LMHeadModel state dict, config.json dict)."""
    heads = int(model_cfg["num_attention_heads"])
    layers = int(model_cfg["num_layers"])
    tied = "output_layer.weight" not in full
    out = {"transformer.wte.weight": full["embedding.word_embeddings.weight"][:vocab],
           "transformer.wpe.weight": full["embedding.position_embeddings.weight"]}
    for i, get in _layers(full, layers):
        h = f"transformer.h.{i}."
        out[h + "ln_1.weight"] = get("input_layernorm.weight")
        out[h + "ln_1.bias"] = get("input_layernorm.bias")
        out[h + "attn.c_attn.weight"] = qkv_ours_to_hf(get(f"{_ATTN}.weight"), heads).t()
        out[h + "attn.c_attn.bias"] = qkv_ours_to_hf(get(f"{_ATTN}.bias"), heads)
        out[h + "attn.c_proj.weight"] = get("self_attention.dense.weight").t()
        out[h + "attn.c_proj.bias"] = get("self_attention.dense.bias")
        out[h + "ln_2.weight"] = get("post_attention_layernorm.weight")
        out[h + "ln_2.bias"] = get("post_attention_layernorm.bias")
        out[h + "mlp.c_fc.weight"] = get("mlp.dense_h_to_4h.weight").t()
        out[h + "mlp.c_fc.bias"] = get("mlp.dense_h_to_4h.bias")
        out[h + "mlp.c_proj.weight"] = get("mlp.dense_4h_to_h.weight").t()
        out[h + "mlp.c_proj.bias"] = get("mlp.dense_4h_to_h.bias")
    out["transformer.ln_f.weight"] = full["encoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = full["encoder.final_layernorm.bias"]
    if not tied:
        out["lm_head.weight"] = full["output_layer.weight"][:vocab]
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab, "n_positions": int(model_cfg["max_position_embeddings"]),
        "n_embd": int(model_cfg["hidden_size"]), "n_layer": layers, "n_head": heads,
        "n_inner": int(model_cfg["ffn_hidden_size"]),
        "activation_function": "gelu_new" if model_cfg.get("openai_gelu") else "gelu",
        "layer_norm_epsilon": float(model_cfg.get("layernorm_epsilon", 1e-5)),
        "resid_pdrop": float(model_cfg.get("hidden_dropout", 0.1)),
        "embd_pdrop": float(model_cfg.get("hidden_dropout", 0.1)),
        "attn_pdrop": float(model_cfg.get("attention_dropout", 0.1)),
        "initializer_range": float(model_cfg.get("init_method_std", 0.02)),
        "scale_attn_weights": True, "tie_word_embeddings": tied, "use_cache": True,
    }
    return out, config


def bert_to_hf(full: Dict[str, torch.Tensor], model_cfg: Dict[str, Any], vocab: int
               ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Our full BERT state dict -> (MegatronBert* state dict, config.json dict)."""
    heads = int(model_cfg["num_attention_heads"])
    layers = int(model_cfg["num_layers"])
    if "lm_head.bias" not in full:
        raise UserError("--to-hf: this BERT checkpoint has no masked-LM head (a finetuned "
                        "model?); only pretraining checkpoints export")
    binary = "binary_head.weight" in full
    out = {"bert.embeddings.word_embeddings.weight":
           full["embedding.word_embeddings.weight"][:vocab],
           "bert.embeddings.position_embeddings.weight":
           full["embedding.position_embeddings.weight"],
           "bert.embeddings.token_type_embeddings.weight":
           full["embedding.tokentype_embeddings.weight"]}
    for i, get in _layers(full, layers):
        h = f"bert.encoder.layer.{i}."
        out[h + "attention.ln.weight"] = get("input_layernorm.weight")
        out[h + "attention.ln.bias"] = get("input_layernorm.bias")
        for part, name in (("weight", "weight"), ("bias", "bias")):
            q, k, v = qkv_ours_to_hf(get(f"{_ATTN}.{part}"), heads).chunk(3, dim=0)
            out[h + f"attention.self.query.{name}"] = q
            out[h + f"attention.self.key.{name}"] = k
            out[h + f"attention.self.value.{name}"] = v
        out[h + "attention.output.dense.weight"] = get("self_attention.dense.weight")
        out[h + "attention.output.dense.bias"] = get("self_attention.dense.bias")
        out[h + "ln.weight"] = get("post_attention_layernorm.weight")
        out[h + "ln.bias"] = get("post_attention_layernorm.bias")
        out[h + "intermediate.dense.weight"] = get("mlp.dense_h_to_4h.weight")
        out[h + "intermediate.dense.bias"] = get("mlp.dense_h_to_4h.bias")
        out[h + "output.dense.weight"] = get("mlp.dense_4h_to_h.weight")
        out[h + "output.dense.bias"] = get("mlp.dense_4h_to_h.bias")
    out["bert.encoder.ln.weight"] = full["encoder.final_layernorm.weight"]
    out["bert.encoder.ln.bias"] = full["encoder.final_layernorm.bias"]
    if "pooler.dense.weight" in full:
        out["bert.pooler.dense.weight"] = full["pooler.dense.weight"]
        out["bert.pooler.dense.bias"] = full["pooler.dense.bias"]
    p = "cls.predictions."
    out[p + "transform.dense.weight"] = full["lm_head.dense.weight"]
    out[p + "transform.dense.bias"] = full["lm_head.dense.bias"]
    out[p + "transform.LayerNorm.weight"] = full["lm_head.layernorm.weight"]
    out[p + "transform.LayerNorm.bias"] = full["lm_head.layernorm.bias"]
    out[p + "bias"] = full["lm_head.bias"][:vocab]
    if binary:
        out["cls.seq_relationship.weight"] = full["binary_head.weight"]
        out["cls.seq_relationship.bias"] = full["binary_head.bias"]
    config = {
        "architectures": ["MegatronBertForPreTraining" if binary else "MegatronBertForMaskedLM"],
        "model_type": "megatron-bert", "vocab_size": vocab,
        "hidden_size": int(model_cfg["hidden_size"]), "num_hidden_layers": layers,
        "num_attention_heads": heads, "intermediate_size": int(model_cfg["ffn_hidden_size"]),
        "hidden_act": "gelu_new" if model_cfg.get("openai_gelu") else "gelu",
        "max_position_embeddings": int(model_cfg["max_position_embeddings"]),
        "type_vocab_size": int(full["embedding.tokentype_embeddings.weight"].shape[0]),
        "layer_norm_eps": float(model_cfg.get("layernorm_epsilon", 1e-5)),
        "hidden_dropout_prob": float(model_cfg.get("hidden_dropout", 0.1)),
        "attention_probs_dropout_prob": float(model_cfg.get("attention_dropout", 0.1)),
        "initializer_range": float(model_cfg.get("init_method_std", 0.02)),
        "position_embedding_type": "absolute", "tie_word_embeddings": True,
    }
    return out, config


def _tokenizer_files(data_cfg: Dict[str, Any], out_dir: str, n_positions: int) -> str:
    """Copy the tokenizer's vocabulary files; returns a one-line note of what was done."""
    kind = data_cfg.get("tokenizer_type")
    files: List[Tuple[Optional[str], str]] = []
    tok_cfg: Dict[str, Any] = {"model_max_length": n_positions}
    if kind == "GPT2BPETokenizer":
        files = [(data_cfg.get("vocab_file"), "vocab.json"),
                 (data_cfg.get("merge_file"), "merges.txt")]
        tok_cfg.update(tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>",
                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        files = [(data_cfg.get("vocab_file"), "vocab.txt")]
        tok_cfg.update(tokenizer_class="BertTokenizer",
                       do_lower_case=kind == "BertWordPieceLowerCase")
    else:
        return (f"no tokenizer files written: the model was trained with {kind}, which has "
                f"no transformers tokenizer equivalent")
    missing = [src for src, _ in files if not src or not os.path.isfile(src)]
    if missing:
        return (f"no tokenizer files written: {kind} files {missing} recorded in the "
                f"checkpoint are not on this machine")
    for src, name in files:
        shutil.copyfile(src, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tok_cfg, fh, indent=2)
    return f"tokenizer files ({kind}): {', '.join(n for _, n in files)}"


def _check_exportable(model_cfg: Dict[str, Any], full: Dict[str, torch.Tensor],
                      is_bert: bool) -> None:
    if not is_bert and "embedding.tokentype_embeddings.weight" in full:
        raise UserError("--to-hf: this GPT has token-type embeddings; transformers' GPT-2 "
                        "has none, so it cannot be exported")
    for name, value in full.items():
        if name.endswith(f"{_ATTN}.weight") and value.shape[0] != 3 * value.shape[1]:
            raise UserError(f"--to-hf: {name} is {tuple(value.shape)}; only standard "
                            f"multi-head attention (q, k, v of hidden size) exports")
    if int(model_cfg.get("num_attention_heads") or 0) < 1:
        raise UserError("--to-hf: the checkpoint's config lacks num_attention_heads")


def export_hf(load: str, out_dir: str, *, iteration: Optional[int] = None,
              true_vocab: Optional[int] = None, allow_unsafe: bool = False) -> str:
    """Write checkpoint ``load`` as a transformers model directory ``out_dir``."""
    from safetensors.torch import save_file


    state = read_full_state(load, iteration, allow_unsafe=allow_unsafe)
    config = state.common.get("config") or {}
    model_cfg = dict(config.get("model") or {})
    if not model_cfg:
        raise CheckpointError(f"--load {load}: the checkpoint records no model config; "
                              f"expected a checkpoint written by this trainer")
    model_cfg.setdefault("num_layers", state.ckpt.num_layers)
    model_cfg.setdefault("ffn_hidden_size", 4 * int(model_cfg["hidden_size"]))
    model_cfg.setdefault("max_position_embeddings", model_cfg.get("seq_length"))
    full = state.model
    is_bert = "lm_head.bias" in full or "embedding.tokentype_embeddings.weight" in full
    _check_exportable(model_cfg, full, is_bert)
    padded = full[WORD_EMBEDDING].shape[0]
    vocab = true_vocab_size(config, true_vocab)
    if vocab is None or vocab > padded:
        _say(f"note: unpadded vocabulary size unknown (pass --true-vocab-size); exporting "
             f"all {padded} rows")
        vocab = padded
    tensors, hf_config = (bert_to_hf if is_bert else gpt_to_hf)(full, model_cfg, vocab)
    dtype = next(iter(tensors.values())).dtype
    hf_config["torch_dtype"] = str(dtype).replace("torch.", "")
    data_cfg = config.get("data") or {}
    if data_cfg.get("tokenizer_type") == "GPT2BPETokenizer" and not is_bert:
        hf_config.update(bos_token_id=50256, eos_token_id=50256)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_config, fh, indent=2)
    _say(_tokenizer_files(data_cfg, out_dir, int(model_cfg["max_position_embeddings"])))
    return out_dir


# --------------------------------------------------------------------------- import
def _read_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    st = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        from safetensors.torch import load_file
        shards = sorted(set(json.load(open(index))["weight_map"].values()))
        out: Dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(os.path.join(hf_dir, shard)))
        return out
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        try:  # tensors only: weights_only refuses any pickled code
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"--from-hf {binary}: expected a plain tensor pickle "
                                  f"(weights_only), found something else "
                                  f"({type(exc).__name__}); convert it to safetensors") from None
    raise CheckpointError(f"--from-hf {hf_dir}: expected model.safetensors (or "
                          f"pytorch_model.bin), found neither")


def hf_gpt2_to_ours(hf_dir: str, divisible_by: int, tp: int
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], int]:
    """(our full state dict with padded vocabulary, model config dict, real vocab size)."""
    from megatron.tokenizer import vocab_size_with_padding

    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"--from-hf {hf_dir}: expected config.json, found none")
    cfg = json.load(open(cfg_path))
    if cfg.get("model_type") != "gpt2":
        raise UserError(f"--from-hf {cfg_path}: expected model_type 'gpt2', found "
                        f"{cfg.get('model_type')!r}")
    for key, ok in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                    ("scale_attn_weights", True)):
        if cfg.get(key, ok) != ok:
            raise UserError(f"--from-hf {cfg_path}: {key}={cfg[key]} has no equivalent in "
                            f"this trainer's GPT (expected {ok})")
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GELU_TANH + _GELU_EXACT:
        raise UserError(f"--from-hf {cfg_path}: activation_function {act!r} has no "
                        f"equivalent here (expected gelu, or gelu_new with --openai-gelu)")
    weights = {k[len("transformer."):] if k.startswith("transformer.") else k: v
               for k, v in _read_hf_weights(hf_dir).items()}
    heads, layers, hidden = int(cfg["n_head"]), int(cfg["n_layer"]), int(cfg["n_embd"])
    vocab = int(cfg["vocab_size"])
    padded = vocab_size_with_padding(vocab, divisible_by, tp)

    def pad(t: torch.Tensor) -> torch.Tensor:
        extra = torch.zeros((padded - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
        return torch.cat([t, extra], 0)

    try:
        full = {"embedding.word_embeddings.weight": pad(weights["wte.weight"]),
                "embedding.position_embeddings.weight": weights["wpe.weight"]}
        for i in range(layers):
            h, o = f"h.{i}.", f"encoder.layers.{i}."
            full[o + "input_layernorm.weight"] = weights[h + "ln_1.weight"]
            full[o + "input_layernorm.bias"] = weights[h + "ln_1.bias"]
            full[o + f"{_ATTN}.weight"] = qkv_hf_to_ours(
                weights[h + "attn.c_attn.weight"].t(), heads)
            full[o + f"{_ATTN}.bias"] = qkv_hf_to_ours(weights[h + "attn.c_attn.bias"], heads)
            full[o + "self_attention.dense.weight"] = weights[h + "attn.c_proj.weight"].t()
            full[o + "self_attention.dense.bias"] = weights[h + "attn.c_proj.bias"]
            full[o + "post_attention_layernorm.weight"] = weights[h + "ln_2.weight"]
            full[o + "post_attention_layernorm.bias"] = weights[h + "ln_2.bias"]
            full[o + "mlp.dense_h_to_4h.weight"] = weights[h + "mlp.c_fc.weight"].t()
            full[o + "mlp.dense_h_to_4h.bias"] = weights[h + "mlp.c_fc.bias"]
            full[o + "mlp.dense_4h_to_h.weight"] = weights[h + "mlp.c_proj.weight"].t()
            full[o + "mlp.dense_4h_to_h.bias"] = weights[h + "mlp.c_proj.bias"]
        full["encoder.final_layernorm.weight"] = weights["ln_f.weight"]
        full["encoder.final_layernorm.bias"] = weights["ln_f.bias"]
    except KeyError as exc:
        raise CheckpointError(f"--from-hf {hf_dir}: weight {exc.args[0]!r} missing; expected "
                              f"a GPT2LMHeadModel / GPT2Model state dict") from None
    if not cfg.get("tie_word_embeddings", True):
        raise UserError(f"--from-hf {cfg_path}: tie_word_embeddings=false; this trainer's "
                        f"GPT ties the output layer to the word embedding")
    full = {k: v.contiguous().clone() for k, v in full.items()}
    model_cfg = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                 "ffn_hidden_size": int(cfg.get("n_inner") or 4 * hidden),
                 "seq_length": int(cfg["n_positions"]),
                 "max_position_embeddings": int(cfg["n_positions"]),
                 "padded_vocab_size": padded,
                 "layernorm_epsilon": float(cfg.get("layer_norm_epsilon", 1e-5)),
                 "hidden_dropout": float(cfg.get("resid_pdrop", 0.1)),
                 "attention_dropout": float(cfg.get("attn_pdrop", 0.1)),
                 "init_method_std": float(cfg.get("initializer_range", 0.02)),
                 "openai_gelu": act in _GELU_TANH,
                 "params_dtype": str(full["embedding.word_embeddings.weight"].dtype)}
    return full, model_cfg, vocab


def import_hf(hf_dir: str, save: str, *, tp: int = 1, pp: int = 1,
              divisible_by: int = 128) -> str:
    """Write HF GPT-2 directory ``hf_dir`` as an iteration-0 checkpoint under ``save``."""

    full, model_cfg, vocab = hf_gpt2_to_ours(hf_dir, divisible_by, tp)
    layers = model_cfg["num_layers"]
    tokenizer = {"make_vocab_size_divisible_by": divisible_by, "vocab_size": vocab}
    if all(os.path.isfile(os.path.join(hf_dir, f)) for f in ("vocab.json", "merges.txt")):
        tokenizer.update(tokenizer_type="GPT2BPETokenizer",
                         vocab_file=os.path.abspath(os.path.join(hf_dir, "vocab.json")),
                         merge_file=os.path.abspath(os.path.join(hf_dir, "merges.txt")))
    config = {"model": model_cfg, "data": tokenizer}
    ckpt = CheckpointShards(root=hf_dir, iteration=0, tensor=1, pipeline=1, num_layers=layers)
    state = FullState(iteration=0, model=full, shadow=None, optimizer=None,
                      common={"consumed_train_samples": 0, "consumed_valid_samples": 0,
                              "lr_scheduler": None, "config": config},
                      layout=(1, 1, 1), ckpt=ckpt)
    out = write_layout(state, save, tp, pp, 1, true_vocab=vocab,
                       source=os.path.abspath(hf_dir))
    tok = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {tokenizer['vocab_file']} "
           f"--merge-file {tokenizer['merge_file']}" if "vocab_file" in tokenizer
           else f"--tokenizer-type NullTokenizer --vocab-size {vocab}")
    _say(f"train with: --num-layers {layers} --hidden-size {model_cfg['hidden_size']} "
         f"--num-attention-heads {model_cfg['num_attention_heads']} --ffn-hidden-size "
         f"{model_cfg['ffn_hidden_size']} --max-position-embeddings "
         f"{model_cfg['max_position_embeddings']} --layernorm-epsilon "
         f"{model_cfg['layernorm_epsilon']}{' --openai-gelu' if model_cfg['openai_gelu'] else ''} "
         f"--make-vocab-size-divisible-by {divisible_by} "
         f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} {tok} "
         f"--load {save} [--finetune]")
    return out

"""Hugging Face ``transformers`` model directories <-> our checkpoints.

Export (``tools/checkpoint_util.py --load CKPT --to-hf DIR``; DIR new or empty, written
as ``DIR.tmp.PID`` and renamed to DIR at the end, so a failed export leaves no DIR):

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
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, CheckpointShards, FullState,
                                         check_not_a_file, check_outside, check_save_path,
                                         read_full_state, recorded_split,
                                         target_stage_counts, true_vocab_size, write_layout)
from megatron.checkpointing import split_text
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
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        spec = data_cfg.get("tokenizer_model")
        try:
            tokenizer = HuggingFaceTokenizer(spec)
        except ValueError as exc:
            return f"no tokenizer files written: {exc}"
        tokenizer.hf.model_max_length = n_positions
        written = tokenizer.hf.save_pretrained(out_dir)
        return (f"tokenizer files ({kind} {spec}): "
                f"{', '.join(sorted(os.path.basename(str(w)) for w in written))}")
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


def check_export_path(load: Optional[str], out_dir: str) -> None:
    """--to-hf must be a new or empty directory outside --load: the export replaces it as
    a whole, so nothing of another model (stale tokenizer files) can stay behind."""
    check_outside(load, out_dir, "--load", "--to-hf")
    check_not_a_file("--to-hf", out_dir)
    try:
        entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    except OSError as exc:
        raise UserError(f"--to-hf {out_dir}: cannot list it ({exc.strerror}); expected a new "
                        f"or empty directory") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UserError(f"--to-hf {out_dir}: expected a new or empty directory, found one "
                        f"holding {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} "
                        f"({shown}); remove it or choose another --to-hf")


def _publish(staging: str, out_dir: str) -> None:
    """Rename the finished ``staging`` directory to ``out_dir`` (new or empty)."""
    try:
        os.replace(staging, out_dir)  # replaces an empty directory; never a non-empty one
    except OSError as exc:
        raise UserError(f"--to-hf {out_dir}: cannot move the export into place "
                        f"({exc.strerror or type(exc).__name__}); expected a new or empty "
                        f"directory") from None


def export_hf(load: str, out_dir: str, *, iteration: Optional[int] = None,
              true_vocab: Optional[int] = None, allow_unsafe: bool = False) -> str:
    """Write checkpoint ``load`` as a transformers model directory ``out_dir`` (new or
    empty).  The files are written into a sibling staging directory that is renamed to
    ``out_dir`` at the end, so a failed or interrupted export leaves no ``out_dir``."""
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
    _check_exportable(model_cfg, full, is_bert)
    padded = full[WORD_EMBEDDING].shape[0]
    vocab = true_vocab_size(config, true_vocab)
    if vocab is None or vocab > padded:
        _say(f"note: unpadded vocabulary size unknown (pass --true-vocab-size); exporting "
             f"all {padded} rows")
        vocab = padded
    try:
        tensors, hf_config = (bert_to_hf if is_bert else gpt_to_hf)(full, model_cfg, vocab)
    except KeyError as exc:  # a layer or head its config implies is not in the files
        raise CheckpointError(f"--load {load}: the checkpoint has no {exc.args[0]!r}, which "
                              f"its config (num_layers {model_cfg.get('num_layers')!r}) "
                              f"implies") from None
    except (TypeError, ValueError, RuntimeError) as exc:  # config values, head split
        raise CheckpointError(f"--load {load}: its config does not describe its tensors "
                              f"({type(exc).__name__}: {exc})") from None
    dtype = next(iter(tensors.values())).dtype
    hf_config["torch_dtype"] = str(dtype).replace("torch.", "")
    data_cfg = config.get("data") or {}
    if data_cfg.get("tokenizer_type") == "GPT2BPETokenizer" and not is_bert:
        hf_config.update(bos_token_id=50256, eos_token_id=50256)
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
        note = _tokenizer_files(data_cfg, staging, int(model_cfg["max_position_embeddings"]))
        _publish(staging, out_dir)
    except OSError as exc:  # unwritable, disk full: nothing half-written stays
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"--to-hf {out_dir}: cannot write the export "
                        f"({exc.strerror or type(exc).__name__}: "
                        f"{exc.filename or staging})") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _say(note)
    return out_dir


# --------------------------------------------------------------------------- import
def _read_json(path: str, what: str) -> Any:
    """A JSON object from ``path``; anything else is one CheckpointError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"--from-hf {path}: expected {what}, found a file that is not "
                              f"readable JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"--from-hf {path}: expected {what} (a JSON object), found "
                              f"{type(doc).__name__}")
    return doc


def _load_safetensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (OSError, SafetensorError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"--from-hf {path}: not a readable safetensors file "
                              f"({exc})") from None


def _read_hf_weights(hf_dir: str, allow_unsafe: bool = False) -> Dict[str, torch.Tensor]:
    st = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(st):
        return _load_safetensors(st)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index, "a safetensors index").get("weight_map")
        shards = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
        for shard in shards:
            # shard names are file names in hf_dir: never a path that leaves it
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                found = (f"shard {shard!r}" if isinstance(weight_map, dict)
                         else f"weight_map {weight_map!r}")
                raise CheckpointError(f"--from-hf {index}: expected a 'weight_map' of tensor "
                                      f"name -> shard file name in {hf_dir}, found {found}")
        out: Dict[str, torch.Tensor] = {}
        for shard in sorted(set(shards)):
            out.update(_load_safetensors(os.path.join(hf_dir, shard)))
        return out
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(binary):
        if not allow_unsafe:
            raise CheckpointError(
                f"--from-hf {binary} is a pickle, which can run code when loaded, so it is "
                f"refused; convert it to model.safetensors, or pass --allow-unsafe-checkpoint "
                f"if you trust its source (it is then read with torch.load(weights_only=True))")
        try:  # tensors only: weights_only refuses any pickled code
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pickle-protocol chatter: the error says it
                weights = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"--from-hf {binary}: expected a plain tensor pickle "
                                  f"(weights_only), found something else "
                                  f"({type(exc).__name__}); convert it to safetensors") from None
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor)
                                                    for v in weights.values()):
            raise CheckpointError(f"--from-hf {binary}: expected a dict of tensors (a state "
                                  f"dict), found {type(weights).__name__}")
        return weights
    raise CheckpointError(f"--from-hf {hf_dir}: expected model.safetensors (or "
                          f"pytorch_model.bin), found neither")


def _config_int(cfg: Dict[str, Any], key: str, cfg_path: str) -> int:
    value = cfg.get(key)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"--from-hf {cfg_path}: expected {key} to be a positive integer, "
                              f"found {value!r}")
    return value


def _config_float(cfg: Dict[str, Any], key: str, default: float, cfg_path: str) -> float:
    value = cfg.get(key, default)
    if type(value) not in (int, float):
        raise CheckpointError(f"--from-hf {cfg_path}: expected {key} to be a number, found "
                              f"{value!r}")
    return float(value)


def hf_gpt2_to_ours(hf_dir: str, divisible_by: int, tp: int, allow_unsafe: bool = False
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], int]:
    """(our full state dict with padded vocabulary, model config dict, real vocab size).

    Every tensor is checked against config.json (shape, floating point) before use, so a
    weight file of another model is one error, not a reshape failure or a silently
    mis-sized checkpoint."""
    from megatron.tokenizer import vocab_size_with_padding

    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"--from-hf {hf_dir}: expected config.json, found none")
    cfg = _read_json(cfg_path, "a transformers config")
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
    heads, layers, hidden, vocab, positions = (
        _config_int(cfg, k, cfg_path) for k in ("n_head", "n_layer", "n_embd", "vocab_size",
                                                "n_positions"))
    ffn = _config_int(cfg, "n_inner", cfg_path) if cfg.get("n_inner") else 4 * hidden
    if hidden % heads:
        raise CheckpointError(f"--from-hf {cfg_path}: n_embd {hidden} is not a multiple of "
                              f"n_head {heads}")
    eps, resid, attn, init = (_config_float(cfg, k, d, cfg_path) for k, d in (
        ("layer_norm_epsilon", 1e-5), ("resid_pdrop", 0.1), ("attn_pdrop", 0.1),
        ("initializer_range", 0.02)))
    weights = {k[len("transformer."):] if k.startswith("transformer.") else k: v
               for k, v in _read_hf_weights(hf_dir, allow_unsafe).items()}
    padded = vocab_size_with_padding(vocab, divisible_by, tp)

    def get(name: str, *shape: int) -> torch.Tensor:
        if name not in weights:
            raise CheckpointError(f"--from-hf {hf_dir}: weight {name!r} missing; expected "
                                  f"a GPT2LMHeadModel / GPT2Model state dict")
        t = weights[name]
        if tuple(t.shape) != shape or not t.is_floating_point():
            raise CheckpointError(
                f"--from-hf {hf_dir}: weight {name!r} is {str(t.dtype).removeprefix('torch.')} "
                f"{tuple(t.shape)}; {cfg_path} (n_embd {hidden}, n_inner {ffn}, vocab_size "
                f"{vocab}, n_positions {positions}) expects floating point {shape}")
        return t

    def pad(t: torch.Tensor) -> torch.Tensor:
        extra = torch.zeros((padded - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
        return torch.cat([t, extra], 0)

    full = {"embedding.word_embeddings.weight": pad(get("wte.weight", vocab, hidden)),
            "embedding.position_embeddings.weight": get("wpe.weight", positions, hidden)}
    for i in range(layers):
        h, o = f"h.{i}.", f"encoder.layers.{i}."
        full[o + "input_layernorm.weight"] = get(h + "ln_1.weight", hidden)
        full[o + "input_layernorm.bias"] = get(h + "ln_1.bias", hidden)
        full[o + f"{_ATTN}.weight"] = qkv_hf_to_ours(
            get(h + "attn.c_attn.weight", hidden, 3 * hidden).t(), heads)
        full[o + f"{_ATTN}.bias"] = qkv_hf_to_ours(get(h + "attn.c_attn.bias", 3 * hidden),
                                                   heads)
        full[o + "self_attention.dense.weight"] = get(h + "attn.c_proj.weight", hidden,
                                                      hidden).t()
        full[o + "self_attention.dense.bias"] = get(h + "attn.c_proj.bias", hidden)
        full[o + "post_attention_layernorm.weight"] = get(h + "ln_2.weight", hidden)
        full[o + "post_attention_layernorm.bias"] = get(h + "ln_2.bias", hidden)
        full[o + "mlp.dense_h_to_4h.weight"] = get(h + "mlp.c_fc.weight", hidden, ffn).t()
        full[o + "mlp.dense_h_to_4h.bias"] = get(h + "mlp.c_fc.bias", ffn)
        full[o + "mlp.dense_4h_to_h.weight"] = get(h + "mlp.c_proj.weight", ffn, hidden).t()
        full[o + "mlp.dense_4h_to_h.bias"] = get(h + "mlp.c_proj.bias", hidden)
    full["encoder.final_layernorm.weight"] = get("ln_f.weight", hidden)
    full["encoder.final_layernorm.bias"] = get("ln_f.bias", hidden)
    if not cfg.get("tie_word_embeddings", True):
        raise UserError(f"--from-hf {cfg_path}: tie_word_embeddings=false; this trainer's "
                        f"GPT ties the output layer to the word embedding")
    full = {k: v.contiguous().clone() for k, v in full.items()}
    model_cfg = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                 "ffn_hidden_size": ffn, "seq_length": positions,
                 "max_position_embeddings": positions, "padded_vocab_size": padded,
                 "layernorm_epsilon": eps, "hidden_dropout": resid, "attention_dropout": attn,
                 "init_method_std": init, "openai_gelu": act in _GELU_TANH,
                 "params_dtype": str(full["embedding.word_embeddings.weight"].dtype)}
    return full, model_cfg, vocab


def import_hf(hf_dir: str, save: str, *, tp: int = 1, pp: int = 1,
              divisible_by: int = 128, allow_unsafe: bool = False,
              first: Optional[int] = None, last: Optional[int] = None) -> str:
    """Write HF GPT-2 directory ``hf_dir`` as an iteration-0 checkpoint under ``save``.
    ``allow_unsafe``: also read a ``pytorch_model.bin`` pickle (weights-only unpickler).
    ``first``/``last``: layers of the first/last pipeline stage (default: even).  A
    ``save`` holding checkpoints is refused (``check_save_path``) before anything is read."""
    check_save_path(hf_dir, save, load_flag="--from-hf")
    full, model_cfg, vocab = hf_gpt2_to_ours(hf_dir, divisible_by, tp, allow_unsafe)
    layers = model_cfg["num_layers"]
    tokenizer = {"make_vocab_size_divisible_by": divisible_by, "vocab_size": vocab}
    if all(os.path.isfile(os.path.join(hf_dir, f)) for f in ("vocab.json", "merges.txt")):
        tokenizer.update(tokenizer_type="GPT2BPETokenizer",
                         vocab_file=os.path.abspath(os.path.join(hf_dir, "vocab.json")),
                         merge_file=os.path.abspath(os.path.join(hf_dir, "merges.txt")))
        from megatron.tokenizer import GPT2BPETokenizer
        try:  # recorded in the checkpoint and printed as flags: they must load
            GPT2BPETokenizer(tokenizer["vocab_file"], tokenizer["merge_file"], fast=False)
        except ValueError as exc:
            raise CheckpointError(f"--from-hf {hf_dir}: its vocab.json/merges.txt do not load "
                                  f"as a GPT-2 tokenizer ({exc})") from None
    config = {"model": model_cfg, "data": tokenizer}
    ckpt = CheckpointShards(root=hf_dir, iteration=0, tensor=1, pipeline=1, num_layers=layers)
    state = FullState(iteration=0, model=full, shadow=None, optimizer=None,
                      common={"consumed_train_samples": 0, "consumed_valid_samples": 0,
                              "lr_scheduler": None, "config": config},
                      layout=(1, 1, 1), ckpt=ckpt)
    out = write_layout(state, save, tp, pp, 1, true_vocab=vocab,
                       source=os.path.abspath(hf_dir), first=first, last=last)
    split = split_text(*recorded_split(target_stage_counts(state, pp, first, last), first,
                                       last))
    tok = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {tokenizer['vocab_file']} "
           f"--merge-file {tokenizer['merge_file']}" if "vocab_file" in tokenizer
           else f"--tokenizer-type NullTokenizer --vocab-size {vocab}")
    _say(f"train with: --num-layers {layers} --hidden-size {model_cfg['hidden_size']} "
         f"--num-attention-heads {model_cfg['num_attention_heads']} --ffn-hidden-size "
         f"{model_cfg['ffn_hidden_size']} --max-position-embeddings "
         f"{model_cfg['max_position_embeddings']} --layernorm-epsilon "
         f"{model_cfg['layernorm_epsilon']}{' --openai-gelu' if model_cfg['openai_gelu'] else ''} "
         f"--make-vocab-size-divisible-by {divisible_by} "
         f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}{split} {tok} "
         f"--load {save} [--finetune]")
    return out

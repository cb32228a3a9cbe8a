"""Hugging Face ``transformers`` model directories -> our checkpoints (the other way:
``megatron.hf_interop``).

Import (``--from-hf DIR --save OUT``): a GPT-2, Llama, Qwen2 or Qwen3 directory
(``config.json`` ``model_type`` "gpt2" -- ``activation_function`` "relu2" as
``--squared-relu`` --, "llama", "qwen2" or "qwen3" -- ``rope_type`` "linear" as
``--rotary-seq-len-interpolation-factor`` --) with ``model.safetensors``
(or a ``pytorch_model.bin``, read with ``torch.load(weights_only=True)``, which refuses
pickled code) becomes an iteration-0 checkpoint of any (t, d) layout, usable with
``--load OUT --finetune`` or ``--load OUT``.  The script prints the model flags the
training run needs (for Llama: ``--normalization RMSNorm --position-embedding-type rope
--swiglu ...``; Llama 3.1/3.2's ``llama3`` RoPE adds ``--use-rope-scaling
--rope-scaling-factor F``, Qwen3 ``--qk-layernorm``, a ``head_dim`` other than hidden /
heads ``--kv-channels``).  Tokenizer files of the model's vocabulary size are recorded
(GPT-2's vocab.json + merges.txt, or any AutoTokenizer directory); otherwise
``--tokenizer-type NullTokenizer --vocab-size V-1`` for a vocab_size of V (its
end-of-document id V-1 comes on top of its V-1 data ids: exactly the V rows written).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Optional, Tuple

import torch

from megatron.checkpoint_convert import (WORD_EMBEDDING, CheckpointShards, FullState,
                                         check_save_path, recorded_split,
                                         target_stage_counts, write_layout)
from megatron.checkpoint_load import split_text
from megatron.errors import CheckpointError, UserError
from megatron.export_output import say
from megatron.hf_layouts import (QKV_NAME, GELU_EXACT, GELU_TANH, LLAMA_FAMILY, RELU_SQUARED,
                                 qkv_groups_to_ours, qkv_hf_to_ours)
from megatron.model.transformer import (LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR,
                                        LLAMA3_ORIGINAL_CONTEXT, flag_number)


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


def _read_hf_config(hf_dir: str) -> Tuple[Dict[str, Any], str]:
    """(config.json of ``hf_dir`` as a dict, its path)."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"--from-hf {hf_dir}: expected config.json, found none")
    return _read_json(cfg_path, "a transformers config"), cfg_path


def _tensor_getter(weights: Dict[str, torch.Tensor], hf_dir: str, kind: str, sizes: str):
    """``get(name, *shape)``: the weight, checked to be a floating-point tensor of that
    shape.  ``kind`` names the state dict expected, ``sizes`` the config.json values the
    shapes come from, so a file of another model is one error naming both.  The names
    taken are collected in ``get.used`` for ``_refuse_unused``."""
    def get(name: str, *shape: int) -> torch.Tensor:
        if name not in weights:
            raise CheckpointError(f"--from-hf {hf_dir}: weight {name!r} missing; expected "
                                  f"a {kind} state dict")
        t = weights[name]
        if tuple(t.shape) != shape or not t.is_floating_point():
            raise CheckpointError(
                f"--from-hf {hf_dir}: weight {name!r} is {str(t.dtype).removeprefix('torch.')} "
                f"{tuple(t.shape)}; {sizes} expects floating point {shape}")
        get.used.add(name)
        return t
    get.used = set()
    get.sizes = sizes
    return get


def _refuse_unused(weights: Dict[str, torch.Tensor], get, hf_dir: str,
                   ignorable: Tuple[str, ...]) -> None:
    """A weight the config does not account for means the config and the weights are of
    two models (config.json says 3 layers, the file holds 4): importing would drop it
    silently, so it is one error naming it.  ``ignorable``: name suffixes that are
    buffers or tied copies, not parameters (GPT-2's causal-mask ``attn.bias``, Llama's
    ``rotary_emb.inv_freq``, the ``lm_head.weight`` of a tied model)."""
    unused = sorted(n for n in weights if n not in get.used
                    and not any(n == s or n.endswith("." + s) for s in ignorable))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4
                                         else "")
        raise CheckpointError(f"--from-hf {hf_dir}: {len(unused)} weight(s) that {get.sizes} "
                              f"does not account for ({shown}); the config and the weights "
                              f"describe different models")


def _pad_rows(t: torch.Tensor, padded: int) -> torch.Tensor:
    """Vocabulary rows padded to Megatron's padded size with the mean of the real rows.

    Padding rows are never an input, but their logits enter the softmax (ours, as
    Megatron-LM's).  A zero row gives logit 0, and a trained GPT-2's logits are far
    below 0 (tens of units): 47 zero rows would take most of the probability and the
    imported model's loss would be wrong by nats.  The mean row's logit is the mean of
    the real logits, so by Jensen each padding row adds at most 1/vocab of the real
    rows' softmax mass, for every input: the loss moves by at most
    log(1 + padding / vocab) (0.0009 for GPT-2's 47 of 50257)."""
    mean = t.double().mean(0, keepdim=True).to(t.dtype)
    return torch.cat([t, mean.expand((padded - t.shape[0],) + tuple(t.shape[1:]))], 0)


def _strip_prefix(weights: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """Names of the base model without ``prefix`` (``transformer.``, ``model.``): the
    LM-head model's and the bare model's files both read."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in weights.items()}


def hf_gpt2_to_ours(hf_dir: str, divisible_by: int, tp: int, allow_unsafe: bool = False
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], int]:
    """(our full state dict with padded vocabulary, model config dict, real vocab size).

    Every tensor is checked against config.json (shape, floating point) before use, so a
    weight file of another model is one error, not a reshape failure or a silently
    mis-sized checkpoint."""
    from megatron.tokenizer import vocab_size_with_padding

    cfg, cfg_path = _read_hf_config(hf_dir)
    if cfg.get("model_type") != "gpt2":
        raise UserError(f"--from-hf {cfg_path}: expected model_type 'gpt2', found "
                        f"{cfg.get('model_type')!r}")
    for key, ok in (("add_cross_attention", False), ("scale_attn_by_inverse_layer_idx", False),
                    ("scale_attn_weights", True)):
        if cfg.get(key, ok) != ok:
            raise UserError(f"--from-hf {cfg_path}: {key}={cfg[key]} has no equivalent in "
                            f"this trainer's GPT (expected {ok})")
    act = cfg.get("activation_function", "gelu_new")
    if act not in GELU_TANH + GELU_EXACT + (RELU_SQUARED,):
        raise UserError(f"--from-hf {cfg_path}: activation_function {act!r} has no "
                        f"equivalent here (expected gelu, gelu_new with --openai-gelu, or "
                        f"relu2 with --squared-relu)")
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
    tied = cfg.get("tie_word_embeddings", True)
    if type(tied) is not bool:
        raise CheckpointError(f"--from-hf {cfg_path}: expected tie_word_embeddings to be "
                              f"true or false, found {tied!r}")
    weights = _strip_prefix(_read_hf_weights(hf_dir, allow_unsafe), "transformer.")
    padded = vocab_size_with_padding(vocab, divisible_by, tp)
    get = _tensor_getter(weights, hf_dir, "GPT2LMHeadModel / GPT2Model",
                         f"{cfg_path} (n_layer {layers}, n_embd {hidden}, n_inner {ffn}, "
                         f"vocab_size {vocab}, n_positions {positions})")

    full = {WORD_EMBEDDING: _pad_rows(get("wte.weight", vocab, hidden), padded),
            "embedding.position_embeddings.weight": get("wpe.weight", positions, hidden)}
    for i in range(layers):
        h, o = f"h.{i}.", f"encoder.layers.{i}."
        full[o + "input_layernorm.weight"] = get(h + "ln_1.weight", hidden)
        full[o + "input_layernorm.bias"] = get(h + "ln_1.bias", hidden)
        full[o + f"{QKV_NAME}.weight"] = qkv_hf_to_ours(
            get(h + "attn.c_attn.weight", hidden, 3 * hidden).t(), heads)
        full[o + f"{QKV_NAME}.bias"] = qkv_hf_to_ours(get(h + "attn.c_attn.bias", 3 * hidden),
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
    if not tied:  # an lm_head of its own: --untie-embeddings-and-output-weights
        full["output_layer.weight"] = _pad_rows(get("lm_head.weight", vocab, hidden), padded)
    _refuse_unused(weights, get, hf_dir, ("attn.bias", "attn.masked_bias")
                   + (("lm_head.weight",) if tied else ()))
    full = {k: v.contiguous().clone() for k, v in full.items()}
    model_cfg = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                 "ffn_hidden_size": ffn, "seq_length": positions,
                 "max_position_embeddings": positions, "padded_vocab_size": padded,
                 "layernorm_epsilon": eps, "hidden_dropout": resid, "attention_dropout": attn,
                 "init_method_std": init, "openai_gelu": act in GELU_TANH,
                 "squared_relu": act == RELU_SQUARED,
                 "untie_embeddings_and_output_weights": not tied,
                 "params_dtype": str(full[WORD_EMBEDDING].dtype)}
    return full, model_cfg, vocab


_ROPE_KEYS = ("rope_type", "rope_theta", "partial_rotary_factor", "factor",
              "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""RoPE settings compared between ``rope_parameters`` and ``rope_scaling``."""


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)


def _rope_settings(cfg: Dict[str, Any], cfg_path: str, positions: int
                   ) -> Tuple[int, Optional[float], Optional[float]]:
    """(--rotary-base, --rope-scaling-factor or None, --rotary-seq-len-interpolation-factor
    or None) of a Llama-family config.json.

    The settings are in ``rope_parameters`` (transformers >= 5; theta inside) or in
    ``rope_scaling`` plus a top-level ``rope_theta`` (older files).  transformers 5.23
    takes ``rope_scaling`` over ``rope_parameters`` and older versions know only the
    former, so a file holding both that disagree describes two models: refused, as is a
    top-level ``rope_theta`` that differs from ``rope_parameters``'.

    ``rope_type`` "default" is plain RoPE; "linear" divides every frequency by
    ``factor``, which is our linear position interpolation; "llama3" is Llama 3.1's
    scaling, which this trainer has with its constants fixed (low_freq_factor 1,
    high_freq_factor 4, original_max_position_embeddings 8192; Megatron-LM's too):
    other constants, any other ``rope_type`` (dynamic, yarn, ...) and partial rotation
    change the angles in ways this trainer's RoPE does not: refused, one line.
    ``original_max_position_embeddings`` is read where transformers 5 reads it: the
    top level first, then the RoPE settings, then ``max_position_embeddings``."""
    found: Dict[str, Dict[str, Any]] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
            raise UserError(f"--from-hf {cfg_path}: expected {key} to be one object of RoPE "
                            f"settings, found {value!r}")
        value = dict(value)
        value.setdefault("rope_type", value.pop("type", "default"))
        if value["rope_type"] not in ("default", "llama3", "linear"):
            raise UserError(f"--from-hf {cfg_path}: {key} has rope_type "
                            f"{value['rope_type']!r} (RoPE scaling), which this trainer's RoPE "
                            f"does not do; only the default RoPE (--rotary-base), 'linear' "
                            f"(--rotary-seq-len-interpolation-factor) and Llama 3.1's "
                            f"'llama3' scaling (--use-rope-scaling) import")
        found[key] = value
    if len(found) == 2:
        a, b = found["rope_parameters"], found["rope_scaling"]
        for k in _ROPE_KEYS:
            if k in a and k in b and a[k] != b[k]:
                raise UserError(f"--from-hf {cfg_path}: rope_parameters and rope_scaling "
                                f"disagree on {k} ({a[k]!r} and {b[k]!r}); transformers "
                                f"versions read different ones, so this file does not say "
                                f"which model it is")
    params = {**found.get("rope_scaling", {}), **found.get("rope_parameters", {})}
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise UserError(f"--from-hf {cfg_path}: partial_rotary_factor {partial!r}; "
                        f"transformers' Llama rotates whole heads, so this file does not "
                        f"describe a model it runs (expected 1.0)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    top = cfg.get("rope_theta")
    if top is not None and "rope_theta" in params and top != params["rope_theta"]:
        raise UserError(f"--from-hf {cfg_path}: rope_theta {top!r} at the top level but "
                        f"{params['rope_theta']!r} in the RoPE settings; transformers versions "
                        f"read different ones, so this file does not say which model it is")
    if not _is_number(theta) or not theta > 0:
        raise CheckpointError(f"--from-hf {cfg_path}: expected rope_theta to be a positive "
                              f"number, found {theta!r}")
    if theta != int(theta):
        raise UserError(f"--from-hf {cfg_path}: rope_theta {theta} is not a whole number; "
                        f"this trainer's --rotary-base takes integers")
    kind = params.get("rope_type", "default")
    if kind == "default":
        return int(theta), None, None
    factor = params.get("factor")
    if not _is_number(factor) or not factor >= 1.0:
        raise CheckpointError(f"--from-hf {cfg_path}: expected the {kind} RoPE factor to be a "
                              f"number >= 1, found {factor!r}")
    if kind == "linear":
        return int(theta), None, float(factor)
    originals = [v for v in (cfg.get("original_max_position_embeddings"),
                             params.get("original_max_position_embeddings")) if v is not None]
    constants = {"low_freq_factor": params.get("low_freq_factor"),
                 "high_freq_factor": params.get("high_freq_factor"),
                 "original_max_position_embeddings": originals[0] if originals else positions}
    fixed = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
             "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
             "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    wrong = [f"{k} {v!r}" for k, v in constants.items()
             if not _is_number(v) or v != fixed[k]]
    if len(set(originals)) > 1:
        wrong.append(f"original_max_position_embeddings {originals[0]!r} at the top level but "
                     f"{originals[1]!r} in the RoPE settings")
    if wrong:
        raise UserError(f"--from-hf {cfg_path}: llama3 RoPE scaling with {', '.join(wrong)}; "
                        f"this trainer's --use-rope-scaling has Llama 3.1's low_freq_factor 1, "
                        f"high_freq_factor 4 and original_max_position_embeddings 8192 fixed "
                        f"(only --rope-scaling-factor is a flag)")
    return int(theta), float(factor), None


def _head_dim(cfg: Dict[str, Any], family: str, hidden: int, heads: int, cfg_path: str) -> int:
    """Dimensions of one attention head (our --kv-channels): config.json's ``head_dim``;
    without one, Qwen3's default of 128 (whatever the width: transformers' Qwen3Config)
    and hidden_size / num_attention_heads for Llama and Qwen2."""
    if family == "qwen3" and "head_dim" not in cfg:
        return 128
    if family == "qwen3" or cfg.get("head_dim") is not None:
        return _config_int(cfg, "head_dim", cfg_path)
    if hidden % heads:
        raise CheckpointError(f"--from-hf {cfg_path}: hidden_size {hidden} is not a multiple "
                              f"of num_attention_heads {heads}, and there is no head_dim")
    return hidden // heads


def hf_llama_to_ours(hf_dir: str, divisible_by: int, tp: int, allow_unsafe: bool = False
                     ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], int]:
    """A ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` directory (or a
    bare ``LlamaModel``/``Qwen2Model``/``Qwen3Model``) -> (our full state dict with padded
    vocabulary, model config dict, real vocab size).

    The model config is the Llama-style GPT (RMSNorm, RoPE, SwiGLU, query groups; Llama's
    attention_bias/mlp_bias as --disable-bias-linear, Qwen2's q/k/v biases as
    --disable-bias-linear --add-qkv-bias, Qwen3's q_norm/k_norm as --qk-layernorm; a
    head_dim other than hidden / heads as --kv-channels; llama3 RoPE scaling as
    --use-rope-scaling; untied unless tie_word_embeddings); the tensors are checked
    against config.json as for GPT-2.  A config.json option that changes what the model
    computes and that this trainer lacks is one UserError naming it."""
    from megatron.tokenizer import vocab_size_with_padding

    cfg, cfg_path = _read_hf_config(hf_dir)
    family = cfg.get("model_type")
    if family not in LLAMA_FAMILY:
        raise UserError(f"--from-hf {cfg_path}: expected model_type 'llama', 'qwen2' or "
                        f"'qwen3', found {family!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"--from-hf {cfg_path}: hidden_act {act!r} has no equivalent here "
                        f"(expected silu: --swiglu)")
    heads, layers, hidden, vocab, ffn = (
        _config_int(cfg, k, cfg_path) for k in ("num_attention_heads", "num_hidden_layers",
                                                "hidden_size", "vocab_size",
                                                "intermediate_size"))
    positions = (_config_int(cfg, "max_position_embeddings", cfg_path)
                 if cfg.get("max_position_embeddings") is not None
                 else {"llama": 2048, "qwen2": 32768, "qwen3": 32768}[family])  # their defaults
    groups = (_config_int(cfg, "num_key_value_heads", cfg_path)
              if cfg.get("num_key_value_heads") is not None else heads)
    if heads % groups:
        raise CheckpointError(f"--from-hf {cfg_path}: num_key_value_heads {groups} does not "
                              f"divide num_attention_heads {heads}")
    d = _head_dim(cfg, family, hidden, heads, cfg_path)
    flags = {}
    for key, default in (("attention_bias", False), ("mlp_bias", False),
                         ("tie_word_embeddings", False), ("use_sliding_window", False)):
        flags[key] = cfg.get(key, default)
        if type(flags[key]) is not bool:
            raise CheckpointError(f"--from-hf {cfg_path}: expected {key} to be true or "
                                  f"false, found {flags[key]!r}")
    if family == "llama":
        bias = qkv_bias = flags["attention_bias"]
        if bias != flags["mlp_bias"]:
            raise UserError(f"--from-hf {cfg_path}: attention_bias={str(bias).lower()} but "
                            f"mlp_bias={str(flags['mlp_bias']).lower()}; this trainer's blocks "
                            f"have biases on all four linear layers or on none "
                            f"(--disable-bias-linear)")
    elif family == "qwen2":  # q, k, v biases, none on o_proj and the MLP
        bias, qkv_bias = False, True
    else:  # Qwen3: no biases (attention_bias would add them to q, k, v and o_proj only)
        bias = qkv_bias = False
        if flags["attention_bias"]:
            raise UserError(f"--from-hf {cfg_path}: attention_bias=true (Qwen3: biases on "
                            f"q, k, v and o_proj, none in the MLP); this trainer's blocks have "
                            f"biases on all four linear layers, on none, or on q, k, v only "
                            f"(--add-qkv-bias)")
    if family != "llama":
        kinds = set(cfg.get("layer_types") or ["full_attention"])
        if flags["use_sliding_window"] or kinds != {"full_attention"}:
            raise UserError(f"--from-hf {cfg_path}: sliding-window attention "
                            f"(use_sliding_window / layer_types) has no equivalent here; "
                            f"only full attention in every layer imports")
    tied = flags["tie_word_embeddings"]
    base, scaling, interpolation = _rope_settings(cfg, cfg_path, positions)
    if d < 2:
        raise CheckpointError(f"--from-hf {cfg_path}: head_dim {d} leaves nothing to rotate")
    eps, attn, init = (_config_float(cfg, k, dflt, cfg_path) for k, dflt in (
        ("rms_norm_eps", 1e-6), ("attention_dropout", 0.0), ("initializer_range", 0.02)))
    weights = _strip_prefix(_read_hf_weights(hf_dir, allow_unsafe), "model.")
    padded = vocab_size_with_padding(vocab, divisible_by, tp)
    get = _tensor_getter(weights, hf_dir, f"{LLAMA_FAMILY[family]} / {family} base model",
                         f"{cfg_path} (num_hidden_layers {layers}, hidden_size {hidden}, "
                         f"intermediate_size {ffn}, num_attention_heads {heads}, "
                         f"num_key_value_heads {groups}, head_dim {d}, vocab_size {vocab})")

    full = {WORD_EMBEDDING: _pad_rows(get("embed_tokens.weight", vocab, hidden), padded)}
    parts = ("weight", "bias") if bias else ("weight",)
    for i in range(layers):  # in our module's parameter order
        h, o = f"layers.{i}.", f"encoder.layers.{i}."
        full[o + "input_layernorm.weight"] = get(h + "input_layernorm.weight", hidden)
        for part in ("weight", "bias") if qkv_bias else ("weight",):
            rest = (hidden,) if part == "weight" else ()
            full[o + f"{QKV_NAME}.{part}"] = qkv_groups_to_ours(
                get(h + f"self_attn.q_proj.{part}", heads * d, *rest),
                get(h + f"self_attn.k_proj.{part}", groups * d, *rest),
                get(h + f"self_attn.v_proj.{part}", groups * d, *rest), groups)
        if family == "qwen3":
            full[o + "self_attention.q_layernorm.weight"] = get(h + "self_attn.q_norm.weight", d)
            full[o + "self_attention.k_layernorm.weight"] = get(h + "self_attn.k_norm.weight", d)
        full[o + "self_attention.dense.weight"] = get(h + "self_attn.o_proj.weight", hidden,
                                                      heads * d)
        if bias:
            full[o + "self_attention.dense.bias"] = get(h + "self_attn.o_proj.bias", hidden)
        full[o + "post_attention_layernorm.weight"] = get(h + "post_attention_layernorm.weight",
                                                          hidden)
        for part in parts:  # [gate; up], gate first: Megatron-LM's SwiGLU layout
            rest = (hidden,) if part == "weight" else ()
            full[o + f"mlp.dense_h_to_4h.{part}"] = torch.cat(
                [get(h + f"mlp.gate_proj.{part}", ffn, *rest),
                 get(h + f"mlp.up_proj.{part}", ffn, *rest)], 0)
        full[o + "mlp.dense_4h_to_h.weight"] = get(h + "mlp.down_proj.weight", hidden, ffn)
        if bias:
            full[o + "mlp.dense_4h_to_h.bias"] = get(h + "mlp.down_proj.bias", hidden)
    full["encoder.final_layernorm.weight"] = get("norm.weight", hidden)
    if not tied:
        full["output_layer.weight"] = _pad_rows(get("lm_head.weight", vocab, hidden), padded)
    _refuse_unused(weights, get, hf_dir, ("rotary_emb.inv_freq",)
                   + (("lm_head.weight",) if tied else ()))
    full = {k: v.contiguous().clone() for k, v in full.items()}
    model_cfg = {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                 "ffn_hidden_size": ffn, "seq_length": positions,
                 "max_position_embeddings": positions, "padded_vocab_size": padded,
                 "layernorm_epsilon": eps, "hidden_dropout": 0.0, "attention_dropout": attn,
                 "init_method_std": init, "openai_gelu": False,
                 "normalization": "RMSNorm", "position_embedding_type": "rope",
                 "rotary_base": base, "rotary_percent": 1.0,
                 "rope_scaling": scaling is not None,
                 "rope_scaling_factor": scaling if scaling is not None else 8.0,
                 "rotary_seq_len_interpolation_factor": interpolation,
                 "swiglu": True, "qk_layernorm": family == "qwen3", "kv_channels": d,
                 "num_query_groups": groups, "add_bias_linear": bias,
                 "add_qkv_bias": qkv_bias and not bias,
                 "untie_embeddings_and_output_weights": not tied,
                 "params_dtype": str(full[WORD_EMBEDDING].dtype)}
    return full, model_cfg, vocab


_IMPORTERS = {"gpt2": hf_gpt2_to_ours, "llama": hf_llama_to_ours, "qwen2": hf_llama_to_ours,
              "qwen3": hf_llama_to_ours}


def _import_tokenizer(hf_dir: str, vocab: int) -> Dict[str, Any]:
    """The tokenizer settings of an imported directory: GPT-2 BPE from vocab.json +
    merges.txt; else any tokenizer transformers' AutoTokenizer loads from it
    (HuggingFaceTokenizer: Llama's tokenizer.json) when its vocabulary has the model's
    size; else none (NullTokenizer, with a note).  Whatever is recorded here is printed
    as flags and must load in the training run."""
    if all(os.path.isfile(os.path.join(hf_dir, f)) for f in ("vocab.json", "merges.txt")):
        tokenizer = {"tokenizer_type": "GPT2BPETokenizer",
                     "vocab_file": os.path.abspath(os.path.join(hf_dir, "vocab.json")),
                     "merge_file": os.path.abspath(os.path.join(hf_dir, "merges.txt"))}
        from megatron.tokenizer import GPT2BPETokenizer
        try:
            size = GPT2BPETokenizer(tokenizer["vocab_file"], tokenizer["merge_file"],
                                    fast=False).vocab_size
        except ValueError as exc:
            raise CheckpointError(f"--from-hf {hf_dir}: its vocab.json/merges.txt do not load "
                                  f"as a GPT-2 tokenizer ({exc})") from None
        if size != vocab:  # a model padded past its tokenizer (50304 rows over 50257)
            say(f"note: no tokenizer recorded: the vocab.json in {hf_dir} has {size} tokens, "
                f"the model's vocab_size is {vocab}; pass your tokenizer's flags when "
                f"training")
            return {}
        return tokenizer
    if not any(os.path.isfile(os.path.join(hf_dir, f))
               for f in ("tokenizer.json", "tokenizer_config.json")):
        return {}
    from megatron.tokenizer.huggingface import HuggingFaceTokenizer

    spec = os.path.abspath(hf_dir)
    try:
        size = HuggingFaceTokenizer(spec).vocab_size
    except ValueError as exc:
        say(f"note: no tokenizer recorded: {exc}")
        return {}
    if size != vocab:
        say(f"note: no tokenizer recorded: the tokenizer in {hf_dir} has {size} tokens, the "
             f"model's vocab_size is {vocab}; pass your tokenizer's flags when training")
        return {}
    return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": spec}


def model_flags(model_cfg: Dict[str, Any]) -> str:
    """The trainer's model flags for an imported config (Megatron-LM's spellings)."""
    flags = [f"--num-layers {model_cfg['num_layers']}",
             f"--hidden-size {model_cfg['hidden_size']}",
             f"--num-attention-heads {model_cfg['num_attention_heads']}",
             f"--ffn-hidden-size {model_cfg['ffn_hidden_size']}",
             f"--max-position-embeddings {model_cfg['max_position_embeddings']}"]
    if model_cfg.get("normalization") == "RMSNorm":
        flags += ["--normalization RMSNorm", f"--norm-epsilon {model_cfg['layernorm_epsilon']}"]
    else:
        flags.append(f"--layernorm-epsilon {model_cfg['layernorm_epsilon']}")
    if model_cfg.get("position_embedding_type") == "rope":
        flags += ["--position-embedding-type rope", f"--rotary-base {model_cfg['rotary_base']}"]
        if model_cfg.get("rope_scaling"):
            flags.append(f"--use-rope-scaling --rope-scaling-factor "
                         f"{flag_number(model_cfg['rope_scaling_factor'])}")
        if model_cfg.get("rotary_seq_len_interpolation_factor") is not None:
            flags.append(f"--rotary-seq-len-interpolation-factor "
                         f"{flag_number(model_cfg['rotary_seq_len_interpolation_factor'])}")
    if model_cfg.get("swiglu"):
        flags.append("--swiglu")
    if model_cfg.get("squared_relu"):
        flags.append("--squared-relu")
    if model_cfg.get("qk_layernorm"):
        flags.append("--qk-layernorm")
    kv = model_cfg.get("kv_channels")
    if kv is not None and kv * model_cfg["num_attention_heads"] != model_cfg["hidden_size"]:
        flags.append(f"--kv-channels {kv}")
    groups = model_cfg.get("num_query_groups")
    if groups is not None and groups != model_cfg["num_attention_heads"]:
        flags.append(f"--group-query-attention --num-query-groups {groups}")
    if model_cfg.get("add_bias_linear") is False:
        flags.append("--disable-bias-linear")
        if model_cfg.get("add_qkv_bias"):
            flags.append("--add-qkv-bias")
    if model_cfg.get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    if model_cfg.get("openai_gelu"):
        flags.append("--openai-gelu")
    if model_cfg.get("swiglu"):  # Llama trains without dropout; the trainer's default is 0.1
        flags.append(f"--hidden-dropout {model_cfg['hidden_dropout']} "
                     f"--attention-dropout {model_cfg['attention_dropout']}")
    return " ".join(flags)


def import_hf(hf_dir: str, save: str, *, tp: int = 1, pp: int = 1,
              divisible_by: int = 128, allow_unsafe: bool = False,
              first: Optional[int] = None, last: Optional[int] = None) -> str:
    """Write HF GPT-2, Llama, Qwen2 or Qwen3 directory ``hf_dir`` as an iteration-0 checkpoint
    under ``save``.  ``allow_unsafe``: also read a ``pytorch_model.bin`` pickle (weights-only
    unpickler).  ``first``/``last``: layers of the first/last pipeline stage (default:
    even).  A ``save`` holding checkpoints is refused (``check_save_path``) before
    anything is read."""
    check_save_path(hf_dir, save, load_flag="--from-hf")
    cfg, cfg_path = _read_hf_config(hf_dir)
    kind = cfg.get("model_type")
    if kind not in _IMPORTERS:
        raise UserError(f"--from-hf {cfg_path}: expected model_type 'gpt2', 'llama', "
                        f"'qwen2' or 'qwen3', found {kind!r}")
    full, model_cfg, vocab = _IMPORTERS[kind](hf_dir, divisible_by, tp, allow_unsafe)
    layers = model_cfg["num_layers"]
    # without tokenizer files: NullTokenizer, as the printed flags say (and
    # --use-checkpoint-args reads).  Its --vocab-size N means N data ids and the
    # end-of-document id N on top: N = vocab - 1 gives the model's vocab ids (the last
    # one the eod), so a training run pads them to the rows written here.
    # tokenizer_vocab_size: the real size, as a training run records it (the export
    # drops the padding rows by it without loading the tokenizer).
    tokenizer = {"make_vocab_size_divisible_by": divisible_by, "tokenizer_vocab_size": vocab,
                 **(_import_tokenizer(hf_dir, vocab)
                    or {"tokenizer_type": "NullTokenizer", "vocab_size": vocab - 1})}
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
    kind_of = tokenizer.get("tokenizer_type")
    tok = (f"--tokenizer-type GPT2BPETokenizer --vocab-file {tokenizer['vocab_file']} "
           f"--merge-file {tokenizer['merge_file']}" if kind_of == "GPT2BPETokenizer" else
           f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
           f"{tokenizer['tokenizer_model']}" if kind_of == "HuggingFaceTokenizer" else
           f"--tokenizer-type NullTokenizer --vocab-size {tokenizer['vocab_size']}")
    say(f"train with: {model_flags(model_cfg)} "
         f"--make-vocab-size-divisible-by {divisible_by} "
         f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}{split} {tok} "
         f"--load {save} [--finetune]")
    return out

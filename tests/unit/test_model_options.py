"""Five Megatron-LM block options, each against an independent float64 reference:
--squared-relu (the MLP by hand), --init-method-xavier-uniform (torch's own
xavier_uniform_ on the full matrix, same generator), --rotary-interleaved and
--rotary-seq-len-interpolation-factor (RoPE's rotation written out pair by pair), and
--apply-residual-connection-post-layernorm (the block's wiring by hand).  Also: their
flags and errors, the executor's saved-tensor count the planner relies on, and the
checkpoint's architecture check.  Tensor parallelism with all of them:
tests/distributed/test_model_options_tp.py; transformers export/import:
tests/unit/test_hf_model_options.py.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron.arguments import ArgumentError, build_config, parse_args, validate_args
from megatron.config import ModelConfig
from megatron.errors import CheckpointError
from megatron.model import GPTModel
from megatron.model.transformer import (ParallelMLP, ParallelTransformerLayer, RotaryEmbedding,
                                        apply_rotary)
from megatron.tensor_parallel import InitKey, TPInfo
from megatron.tensor_parallel.param_init import full_tensor, init_method_xavier_uniform

TP = TPInfo.single()


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                ffn_hidden_size=48, padded_vocab_size=64, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=torch.float64)
    base.update(kw)
    return ModelConfig(**base)


def _perturbed(module: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Norm weights away from 1 and biases away from 0, so a dropped one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


# ------------------------------------------------------------------------- squared relu
def test_squared_relu_mlp_is_relu_squared_by_hand():
    cfg = _config(squared_relu=True)
    mlp = _perturbed(ParallelMLP(cfg, TP, InitKey(1, 0)))
    x = torch.randn(5, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    w1, b1 = mlp.dense_h_to_4h.weight.detach(), mlp.dense_h_to_4h.bias.detach()
    w2, b2 = mlp.dense_4h_to_h.weight.detach(), mlp.dense_4h_to_h.bias.detach()
    pre = x @ w1.T + b1
    expected = torch.where(pre > 0, pre * pre, torch.zeros_like(pre)) @ w2.T + b2
    torch.testing.assert_close(mlp(x), expected, rtol=0, atol=1e-12)
    gelu = ParallelMLP(dataclasses.replace(cfg, squared_relu=False), TP, InitKey(1, 0))
    gelu.load_state_dict(mlp.state_dict())
    assert (gelu(x) - expected).abs().max() > 1e-3  # the test tells the two apart


def test_squared_relu_reaches_the_gpt_model():
    cfg = _config(squared_relu=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model = GPTModel(cfg, TP, seed=3).eval()
    plain = GPTModel(dataclasses.replace(cfg, squared_relu=False), TP, seed=3).eval()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    with torch.no_grad():
        assert (model(ids, None, None) - plain(ids, None, None)).abs().max() > 1e-6


# ------------------------------------------------------------------------------ xavier
def test_xavier_is_torchs_xavier_uniform_of_the_full_matrix():
    """The draw equals torch.nn.init.xavier_uniform_ on the whole [out, in] matrix with
    the parameter's own generator: fans of the full matrix, whatever t cuts it into."""
    key = InitKey(7, 3, "mlp.dense_h_to_4h.weight")
    ours = full_tensor((96, 32), key, init_method_xavier_uniform(), torch.float64)
    ref = torch.empty(96, 32, dtype=torch.float64)
    torch.nn.init.xavier_uniform_(ref, generator=key.generator())
    assert torch.equal(ours, ref)
    bound = math.sqrt(6.0 / (96 + 32))
    assert ours.abs().max() <= bound and ours.abs().max() > 0.95 * bound


def test_xavier_draws_every_matrix_of_the_model_unscaled():
    """Embeddings, the four block matrices and the untied output layer are all U(-a, a)
    of their full shape (output projections not scaled by 1/sqrt(2L), as Megatron-LM's
    xavier mode); biases stay 0 and norms 1."""
    cfg = _config(init_method_xavier_uniform=True, untie_embeddings_and_output_weights=True,
                  num_layers=4, ffn_hidden_size=256, padded_vocab_size=256)
    model = GPTModel(cfg, TP, seed=3)
    plain = GPTModel(dataclasses.replace(cfg, init_method_xavier_uniform=False), TP, seed=3)
    normal = dict(plain.named_parameters())
    matrices = 0
    for name, p in model.named_parameters():
        if p.dim() == 2:
            matrices += 1
            out, inp = p.shape
            bound = math.sqrt(6.0 / (out + inp))
            assert p.abs().max() <= bound, name
            assert p.abs().max() > 0.9 * bound, name  # uniform up to the bound
            # the variance of U(-a, a) is a^2 / 3 = 2 / (fan_in + fan_out)
            assert abs(p.var().item() / (2.0 / (out + inp)) - 1.0) < 0.1, name
            assert not torch.equal(p, normal[name]), name
        else:
            assert torch.equal(p, normal[name]), name
    assert matrices == 3 + 4 * 4  # word, position, output + 4 per layer


def test_xavier_keeps_tensor_parallel_slices_of_one_matrix():
    """A rank's slice of a column/row-parallel weight is cut from the full draw (not a
    draw of the slice, whose narrower fan would widen the bound)."""
    from megatron.tensor_parallel.param_init import partitioned_tensor, unshard

    key = InitKey(5, 0, "self_attention.dense.weight")
    init = init_method_xavier_uniform()
    full = full_tensor((32, 64), key, init, torch.float64)
    for dim in (0, 1):
        parts = [partitioned_tensor((32, 64), key, init, torch.float64, dim, r, 2)
                 for r in range(2)]
        assert torch.equal(unshard(parts, dim), full)


# ------------------------------------------------------------------------------- RoPE
def _rope_by_hand(x: torch.Tensor, rotary_dim: int, base: float, factor: float,
                  interleaved: bool) -> torch.Tensor:
    """x [s, b, heads, d]: pair i (dimensions (2i, 2i+1) interleaved, else (i, i + r/2))
    turned by the angle (p / factor) * base^(-2i / r), loops over positions and pairs."""
    out = x.clone()
    s, half = x.size(0), rotary_dim // 2
    for p in range(s):
        for i in range(half):
            angle = (p / factor) * base ** (-2.0 * i / rotary_dim)
            c, sn = math.cos(angle), math.sin(angle)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            xa, xb = x[p, ..., a], x[p, ..., b]
            out[p, ..., a] = xa * c - xb * sn
            out[p, ..., b] = xa * sn + xb * c
    return out


@pytest.mark.parametrize("interleaved,factor,percent", [
    (True, None, 1.0), (True, None, 0.5), (False, 4.0, 1.0), (True, 2.5, 0.5),
    (False, None, 1.0)])
def test_rotary_layouts_and_interpolation_by_hand(interleaved, factor, percent):
    cfg = _config(position_embedding_type="rope", rotary_interleaved=interleaved,
                  rotary_seq_len_interpolation_factor=factor, rotary_percent=percent,
                  rotary_base=100)
    x = torch.randn(12, 2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cos, sin = RotaryEmbedding(cfg)(12, x.device, x.dtype)
    ours = apply_rotary(x, cos, sin, interleaved=interleaved)
    ref = _rope_by_hand(x, cfg.rotary_dim, 100.0, factor or 1.0, interleaved)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    if interleaved:  # the other layout is another function
        assert (apply_rotary(x, *RotaryEmbedding(dataclasses.replace(
            cfg, rotary_interleaved=False))(12, x.device, x.dtype)) - ref).abs().max() > 1e-3


def test_interpolation_factor_n_gives_position_p_the_angles_of_p_over_n():
    cfg = _config(position_embedding_type="rope")
    plain = RotaryEmbedding(cfg)(16, torch.device("cpu"), torch.float64)
    stretched = RotaryEmbedding(dataclasses.replace(
        cfg, rotary_seq_len_interpolation_factor=4.0))(64, torch.device("cpu"), torch.float64)
    for a, b in zip(plain, stretched):
        torch.testing.assert_close(b[::4], a, rtol=0, atol=1e-15)


def test_interleaved_attention_is_rotate_half_on_reordered_heads():
    """The model-level identity the transformers export relies on: a GPT with
    interleaved RoPE computes what a rotate-half GPT computes when each query/key head's
    rows are reordered [even dims, odd dims]."""
    from megatron.hf_layouts import rotate_half_order

    cfg = _config(position_embedding_type="rope", rotary_interleaved=True,
                  num_query_groups=2, qk_layernorm=True)
    ours = _perturbed(GPTModel(cfg, TP, seed=4)).eval()
    half = GPTModel(dataclasses.replace(cfg, rotary_interleaved=False), TP, seed=4).eval()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    d, per, g = cfg.kv_channels, cfg.num_attention_heads // 2, 2
    order = rotate_half_order(d)
    for name in list(state):
        if name.endswith("query_key_value.weight") or name.endswith("query_key_value.bias"):
            t = state[name].unflatten(0, (g, per + 2, d))
            t[:, :per + 1] = t[:, :per + 1, order]  # queries and key, not the value
            state[name] = t.flatten(0, 2)
        if name.endswith(("q_layernorm.weight", "q_layernorm.bias", "k_layernorm.weight",
                          "k_layernorm.bias")):
            state[name] = state[name][order]
    half.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(half(ids, None, None), ours(ids, None, None),
                                   rtol=0, atol=1e-10)


# ------------------------------------------------------------------ post-LN residual
@pytest.mark.parametrize("post", [True, False])
def test_residual_wiring_by_hand(post):
    cfg = _config(apply_residual_connection_post_layernorm=post, normalization="RMSNorm")
    layer = _perturbed(ParallelTransformerLayer(cfg, TP, 0, seed=1)).eval()
    x = torch.randn(16, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    with torch.no_grad():
        n1 = ln1(x)
        y = (n1 if post else x) + layer.self_attention(n1, None, None)
        n2 = ln2(y)
        expected = (n2 if post else y) + layer.mlp(n2)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
        other = dataclasses.replace(cfg, apply_residual_connection_post_layernorm=not post)
        flipped = ParallelTransformerLayer(other, TP, 0, seed=1).eval()
        flipped.load_state_dict(layer.state_dict())
        assert (flipped(x) - expected).abs().max() > 1e-3


# ------------------------------------------------------------- memory the planner counts
@pytest.mark.parametrize("options,base", [
    ({"squared_relu": True}, {}),
    ({"apply_residual_connection_post_layernorm": True}, {}),
    ({"rotary_interleaved": True}, {"position_embedding_type": "rope"}),
    ({"rotary_interleaved": True, "rotary_percent": 0.5, "num_query_groups": 2},
     {"position_embedding_type": "rope", "rotary_percent": 0.5, "num_query_groups": 2}),
    ({"rotary_seq_len_interpolation_factor": 4.0}, {"position_embedding_type": "rope"}),
    ({"init_method_xavier_uniform": True}, {}),
])
def test_options_keep_the_tensors_the_planner_counts(options, base):
    """The planner models none of these options: the executor's saved-tensor counter
    must charge a layer with them exactly what it charges the layer without them (whose
    bytes tests/unit/test_planner_llama.py holds to the planner's closed form)."""
    from tests.unit.test_planner_llama import _layer_stash

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
              ffn_hidden_size=40, padded_vocab_size=64, hidden_dropout=0.0,
              attention_dropout=0.0)
    with_options = ModelConfig(**kw, **{**base, **options})
    without = ModelConfig(**kw, **base)
    assert _layer_stash(with_options, 2) == _layer_stash(without, 2)


# -------------------------------------------------------------------------- arguments
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--lr", "1e-3"]


def test_flags_reach_the_model_config():
    args = validate_args(parse_args(SMALL + [
        "--squared-relu", "--init-method-xavier-uniform", "--position-embedding-type", "rope",
        "--rotary-interleaved", "--rotary-seq-len-interpolation-factor", "4",
        "--apply-residual-connection-post-layernorm"]), 1)
    model = build_config(args).model
    assert (model.squared_relu, model.init_method_xavier_uniform, model.rotary_interleaved,
            model.rotary_seq_len_interpolation_factor,
            model.apply_residual_connection_post_layernorm) == (True, True, True, 4.0, True)
    plain = build_config(validate_args(parse_args(SMALL), 1)).model
    assert (plain.squared_relu, plain.init_method_xavier_uniform, plain.rotary_interleaved,
            plain.rotary_seq_len_interpolation_factor,
            plain.apply_residual_connection_post_layernorm) == (False, False, False, None, False)


def test_use_checkpoint_args_takes_the_options(tmp_path):
    """--use-checkpoint-args reads the new block options from the --load checkpoint's
    recorded config, as the other block flags (the command line still wins)."""
    import contextlib
    import io

    import pretrain_gpt
    from megatron.training import pretrain

    ck = str(tmp_path / "ck")
    options = ["--squared-relu", "--position-embedding-type", "rope", "--rotary-interleaved",
               "--rotary-seq-len-interpolation-factor", "2",
               "--apply-residual-connection-post-layernorm"]
    with contextlib.redirect_stdout(io.StringIO()):
        pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step,
                 argv=SMALL + options + ["--eval-iters", "0", "--num-workers", "0",
                                         "--save", ck, "--train-iters", "1"])
    later = ["--use-checkpoint-args", "--load", ck, "--micro-batch-size", "2",
             "--train-iters", "4", "--lr", "1e-4", "--mock-data"]
    model = build_config(validate_args(parse_args(later), 1)).model
    assert (model.squared_relu, model.position_embedding_type, model.rotary_interleaved,
            model.rotary_seq_len_interpolation_factor,
            model.apply_residual_connection_post_layernorm) == (True, "rope", True, 2.0, True)
    stretched = build_config(validate_args(parse_args(
        later + ["--rotary-seq-len-interpolation-factor", "4"]), 1)).model
    assert stretched.rotary_seq_len_interpolation_factor == 4.0


def test_the_flags_are_no_longer_refused():
    from megatron import megatron_lm_flags

    names = {f.name for f in megatron_lm_flags.FLAGS}
    for flag in ("--squared-relu", "--init-method-xavier-uniform", "--rotary-interleaved",
                 "--rotary-seq-len-interpolation-factor",
                 "--apply-residual-connection-post-layernorm"):
        assert flag not in names, flag


@pytest.mark.parametrize("extra,text", [
    (["--squared-relu", "--swiglu"],
     "--squared-relu and --swiglu are two MLP activations: give one of them"),
    (["--squared-relu", "--openai-gelu"],
     "--squared-relu and --openai-gelu are two MLP activations: give one of them"),
    (["--swiglu", "--openai-gelu"],
     "--swiglu and --openai-gelu are two MLP activations: give one of them"),
    (["--rotary-interleaved"], "--rotary-interleaved needs --position-embedding-type rope"),
    (["--rotary-seq-len-interpolation-factor", "2"],
     "--rotary-seq-len-interpolation-factor needs --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0.5"],
     "--rotary-seq-len-interpolation-factor must be >= 1"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "nan"],
     "--rotary-seq-len-interpolation-factor must be a finite number"),
])
def test_bad_combinations_are_one_error_naming_the_flags(extra, text):
    with pytest.raises(ArgumentError) as info:
        validate_args(parse_args(SMALL + extra), 1)
    assert text in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kw,text", [
    (dict(squared_relu=True, swiglu=True), "--squared-relu and --swiglu"),
    (dict(rotary_interleaved=True), "--rotary-interleaved needs --position-embedding-type rope"),
    (dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=0.0),
     "--rotary-seq-len-interpolation-factor 0.0: expected a number >= 1"),
])
def test_a_model_built_directly_checks_the_options_too(kw, text):
    with pytest.raises(ValueError, match=text):
        GPTModel(_config(**kw), TP, seed=1)


def test_bert_takes_the_block_options_that_are_not_llamas():
    """BERT's block is ParallelTransformer too: --squared-relu, the post-norm residual and
    xavier init build; the RoPE options need RoPE, which BERT refuses anyway."""
    import pretrain_bert

    argv = SMALL + ["--squared-relu", "--apply-residual-connection-post-layernorm",
                    "--init-method-xavier-uniform"]
    args = parse_args(argv, extra_args_provider=pretrain_bert.add_bert_args)
    model = build_config(validate_args(args, 1)).model
    assert model.squared_relu and model.apply_residual_connection_post_layernorm


# ------------------------------------------------------------------------ checkpoints
def _saved(cfg: ModelConfig, drop=()) -> dict:
    record = {k: (str(v) if isinstance(v, torch.dtype) else v)
              for k, v in dataclasses.asdict(cfg).items() if k not in drop}
    return {"model": record}


@pytest.mark.parametrize("saved_kw,run_kw,flag", [
    ({}, {"squared_relu": True}, "--squared-relu off in the checkpoint, on in this run"),
    ({"apply_residual_connection_post_layernorm": True}, {},
     "--apply-residual-connection-post-layernorm on in the checkpoint, off in this run"),
    ({"position_embedding_type": "rope"},
     {"position_embedding_type": "rope", "rotary_interleaved": True},
     "--rotary-interleaved off in the checkpoint, on in this run"),
])
def test_resuming_with_another_option_is_refused(saved_kw, run_kw, flag):
    from megatron.checkpoint_shape import check_model_shape

    with pytest.raises(CheckpointError) as info:
        check_model_shape("ckpt", _saved(_config(**saved_kw)), _config(**run_kw))
    assert flag in str(info.value)


def test_old_checkpoints_and_init_only_options_load():
    """A checkpoint from before the options (no keys) is of the default block; the
    initialiser is not the model's shape (the weights come from the checkpoint)."""
    from megatron.checkpoint_shape import check_model_shape

    new_keys = ("squared_relu", "apply_residual_connection_post_layernorm",
                "rotary_interleaved", "rotary_seq_len_interpolation_factor",
                "init_method_xavier_uniform")
    rope = _config(position_embedding_type="rope")
    check_model_shape("ckpt", _saved(rope, drop=new_keys), rope)
    check_model_shape("ckpt", _saved(_config()), _config(init_method_xavier_uniform=True))
    # position interpolation stretches a loaded RoPE model's context: the factor and the
    # sequence length may change at --load (no table depends on either)
    longer = _config(position_embedding_type="rope", rotary_seq_len_interpolation_factor=4.0,
                     seq_length=4 * rope.seq_length,
                     max_position_embeddings=4 * rope.max_position_embeddings)
    check_model_shape("ckpt", _saved(rope), longer)
    with pytest.raises(CheckpointError, match="--max-position-embeddings"):  # a table
        check_model_shape("ckpt", _saved(_config()), _config(
            seq_length=4 * rope.seq_length, max_position_embeddings=4 * rope.max_position_embeddings))
    with pytest.raises(CheckpointError, match="--squared-relu"):
        check_model_shape("ckpt", _saved(_config(), drop=new_keys), _config(squared_relu=True))

"""Document boundaries inside GPT samples: --eod-mask-loss, --reset-position-ids and
--reset-attention-mask (``megatron.data.document_masks``), in the model, the planner and
the argument checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.config import ModelConfig
from megatron.data.document_masks import document_ids, ltor_masks_and_position_ids
from megatron.model import GPTModel
from megatron.tensor_parallel import TPInfo

EOD = 7


def _reference(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM's semantics written as a plain loop over each row's eod positions
    (the hand-written reference the vectorised code is held to)."""
    b, s = tokens.shape
    mask = torch.tril(torch.ones(b, s, s)).view(b, 1, s, s)
    loss_mask = torch.ones(b, s)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    positions = torch.arange(s).unsqueeze(0).repeat(b, 1)
    for row in range(b):
        previous = 0
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            if reset_attention_mask:
                mask[row, 0, i + 1:, :i + 1] = 0
            if reset_position_ids:
                positions[row, i + 1:] -= i + 1 - previous
                previous = i + 1
    return mask < 0.5, loss_mask, positions


def _tokens(b=5, s=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 12, (b, s), generator=g)
    tokens[0, 0] = EOD            # a sample that starts with an eod
    tokens[1, -1] = EOD           # ...ends with one
    tokens[2, 4:7] = EOD          # consecutive eods: one-token documents
    tokens[3] = 3                 # no eod at all
    tokens[4, ::2] = EOD          # many
    return tokens


@pytest.mark.parametrize("flags", [(r, a, e) for r in (False, True) for a in (False, True)
                                   for e in (False, True)])
def test_masks_equal_the_loop_reference(flags):
    reset_pos, reset_att, eod_loss = flags
    tokens = _tokens()
    mask, loss_mask, pos = ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=reset_pos, reset_attention_mask=reset_att,
        eod_mask_loss=eod_loss)
    ref_mask, ref_loss, ref_pos = _reference(tokens, EOD, reset_pos, reset_att, eod_loss)
    assert torch.equal(pos, ref_pos) and pos.dtype == torch.int64
    assert torch.equal(loss_mask, ref_loss) and loss_mask.dtype == torch.float32
    if reset_att:
        assert mask.dtype == torch.bool and torch.equal(mask, ref_mask)
        assert not mask.all(dim=-1).any()    # every query sees at least itself: no NaN rows
    else:
        assert mask is None                  # causal: the fused causal kernels stay in use


def test_document_ids_and_errors():
    tokens = torch.tensor([[1, EOD, 2, EOD, EOD, 3]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 1, 2, 3]]
    with pytest.raises(ValueError, match="end-of-document id"):
        ltor_masks_and_position_ids(tokens, None, reset_attention_mask=True)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        ltor_masks_and_position_ids(tokens[0], EOD)
    _, ones, pos = ltor_masks_and_position_ids(tokens, None)
    assert ones.tolist() == [[1.0] * 6] and pos.tolist() == [list(range(6))]


def _gpt(position_embedding_type, backend, s):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=s,
                      max_position_embeddings=s, padded_vocab_size=64, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype=torch.float64,
                      position_embedding_type=position_embedding_type,
                      attention_backend=backend)
    return GPTModel(cfg, TPInfo.single(), pre_process=True, post_process=True,
                    layer_numbers=range(2), seed=3).eval()


@pytest.mark.parametrize("backend", ["auto", "local"])
@pytest.mark.parametrize("rope", [False, True])
def test_packed_documents_give_each_documents_own_losses(rope, backend):
    """Two documents packed into one sample, with both resets, give every token the
    per-token loss it gets when its document runs alone.  With RoPE the attention mask
    alone does it (rotary scores depend on position differences only)."""
    s = 16
    model = _gpt("rope" if rope else "learned_absolute", backend, s)
    g = torch.Generator().manual_seed(1)
    first = torch.cat([torch.randint(0, 7, (6,), generator=g), torch.tensor([EOD])])
    second = torch.randint(8, 64, (s + 1 - first.numel(),), generator=g)
    text = torch.cat([first, second]).unsqueeze(0)
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, _, pos = ltor_masks_and_position_ids(tokens, EOD, reset_position_ids=not rope,
                                               reset_attention_mask=True)
    packed = model(tokens, pos, mask, labels=labels)[0]
    n = first.numel()
    for lo, hi in ((0, n), (n, s)):
        alone = model(tokens[:, lo:hi], torch.arange(hi - lo).unsqueeze(0), None,
                      labels=labels[:, lo:hi])[0]
        torch.testing.assert_close(packed[lo:hi], alone, rtol=1e-10, atol=1e-10)
    # without the mask the second document sees the first: different losses
    leaky = model(tokens, torch.arange(s).unsqueeze(0), None, labels=labels)[0]
    assert not torch.allclose(leaky[n:], packed[n:], rtol=1e-6, atol=1e-6)


def test_planner_counts_the_document_mask_once_per_stage():
    """What the executor's counter sees of a GPT stage with the document mask, beyond a
    causal one, is ``ModelSpec.stage_mask_bytes`` (an additive fp32 mask here: twice the
    formula's fp16), the same for 1 and 3 layers; the cost model adds it per stage."""
    from megatron.pipeline.memory import StashTracker
    from megatron.pipeline.planner import Config, CostModel, ModelSpec

    from tests.unit.test_planner_llama import PLAIN

    s, b = 16, 3
    tokens = _tokens(s=s)[:b]
    mask, _, pos = ltor_masks_and_position_ids(tokens, EOD, reset_attention_mask=True)
    spec = ModelSpec(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=s,
                     vocab_size=64, reset_attention_mask=True)
    for layers in (1, 3):
        cfg = ModelConfig(num_layers=layers + 2, hidden_size=32, num_attention_heads=4,
                          seq_length=s, max_position_embeddings=s, padded_vocab_size=64,
                          hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(cfg, TPInfo.single(), pre_process=False, post_process=False,
                         layer_numbers=range(1, layers + 1), seed=1).train()
        counted = []
        for m in (None, mask):
            x = torch.randn(s, b, 32, requires_grad=True)
            model.set_input_tensor(x)
            tracker = StashTracker({p.untyped_storage().data_ptr() for p in model.parameters()})
            with tracker.counting(0):
                out = model(None, None, m)
            out.sum().backward()
            counted.append(tracker.in_flight[0])
        assert counted[1] - counted[0] == 2 * spec.stage_mask_bytes(b) == 2 * 2 * b * s * s
    causal = dataclasses.replace(spec, reset_attention_mask=False)
    assert causal.stage_mask_bytes(b) == 0.0
    cfg = Config(w=1, d=1, b=b, m=2, schedule="flush")
    with_mask = CostModel(spec, PLAIN).stage_costs(cfg)[0].activation_per_microbatch_bytes
    without = CostModel(causal, PLAIN).stage_costs(cfg)[0].activation_per_microbatch_bytes
    assert with_mask - without == pytest.approx(spec.stage_mask_bytes(b))
    assert "document attention mask" in spec.describe()
    with pytest.raises(ValueError, match="--reset-attention-mask applies to GPT"):
        dataclasses.replace(spec, kind="bert")


def test_plan_cli_passes_the_flag_on():
    from tests.unit.test_planner_llama import _plan

    res = _plan("--model", "gpt-1.3b", "--reset-attention-mask", "--num-gpus", "8",
                "--max-batch-size", "64")
    assert res.returncode == 0, res.stderr
    assert "--reset-attention-mask" in res.stdout and "document attention mask" in res.stdout
    res = _plan("--model", "bert-355m", "--reset-attention-mask",
                "--num-gpus", "8", "--max-batch-size", "64")
    assert res.returncode != 0 and "GPT models only" in res.stderr


def test_arguments_map_and_refuse():
    from megatron.arguments import ArgumentError, build_config, parse_args, validate_args

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
            "2", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
            "--vocab-size", "64", "--lr", "1e-3"]
    args = validate_args(parse_args(base + ["--reset-position-ids", "--reset-attention-mask"]), 1)
    data = build_config(args).data
    assert data.reset_position_ids and data.reset_attention_mask and not data.eod_mask_loss
    args = validate_args(parse_args(base + ["--reset-attention-mask", "--eod-mask-loss"]), 1)
    args.num_tokentypes = 2                               # what pretrain_bert.py adds
    with pytest.raises(ArgumentError, match="--eod-mask-loss, --reset-attention-mask: GPT only"):
        build_config(args)


def test_per_token_loss_only_where_the_entry_point_reports_token_counts(capsys):
    from megatron.arguments import parse_and_validate

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
            "2", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
            "--vocab-size", "64", "--lr", "1e-3", "--calculate-per-token-loss"]
    _, cfg = parse_and_validate(argv, world_size=1, per_token_loss=True)
    assert cfg.training.calculate_per_token_loss
    with pytest.raises(SystemExit) as exit_info:      # pretrain_bert.py, the task scripts
        parse_and_validate(argv, world_size=1)
    assert exit_info.value.code == 2
    assert "error: --calculate-per-token-loss is built for pretrain_gpt.py only" in \
        capsys.readouterr().err

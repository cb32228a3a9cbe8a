"""Pure logic of the 2BW mitigations (megatron.optimizer.staleness) and their flags."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron.optimizer import get_megatron_optimizer
from megatron.optimizer.staleness import WeightPrediction, delay_compensate_
from megatron.pipeline.weights import WeightBuffers


def _opt_cfg(optimizer: str = "adam") -> SimpleNamespace:
    return SimpleNamespace(optimizer=optimizer, lr=1e-2, weight_decay=0.1, adam_beta1=0.9,
                           adam_beta2=0.99, adam_eps=1e-8, sgd_momentum=0.9, clip_grad=0.0)


def _prec(half: bool = False) -> SimpleNamespace:
    return SimpleNamespace(fp16=False, bf16=half, fp32_master_weights=half, loss_scale=None,
                           initial_loss_scale=1.0, min_loss_scale=1.0, loss_scale_window=1,
                           hysteresis=1)


def _model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)


def _fake_grads(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_prediction_is_the_optimizers_zero_gradient_step(name):
    model = _model()
    opt = get_megatron_optimizer(_opt_cfg(name), _prec(), list(model.parameters()))
    params = list(model.parameters())
    for seed in range(3):  # build some optimizer state
        _fake_grads(params, seed)
        opt.step(params, params, params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    # the rule, by torch itself: one step with zero gradients on a copy of the state
    index = {id(m): i for i, m in enumerate(opt.main_params)}
    order = [index[id(m)] for g in opt.optimizer.param_groups for m in g["params"]]
    twin = copy.deepcopy(opt.optimizer)
    twin_params = [m for g in twin.param_groups for m in g["params"]]
    for group in twin.param_groups:
        group["lr"] = 5e-3
    for m, i in zip(twin_params, order):
        m.data = before[i].clone()
        m.grad = torch.zeros_like(m)
    twin.step()
    expected = [None] * len(before)
    for m, i in zip(twin_params, order):
        expected[i] = m.data
    wp = WeightPrediction(opt.optimizer, opt.main_params)
    out = [nn.Parameter(torch.empty_like(w)) for w in before]
    wp.predict_(out, before, 5e-3)
    for o, e in zip(out, expected):
        torch.testing.assert_close(o.data, e, rtol=1e-12, atol=1e-14)
    assert not torch.equal(out[0].data, before[0])
    wp.restore_(out)  # inverts it, with the same state and lr
    for o, w in zip(out, before):
        torch.testing.assert_close(o.data, w, rtol=1e-12, atol=1e-14)


def test_prediction_without_state_is_identity():
    model = _model()
    opt = get_megatron_optimizer(_opt_cfg(), _prec(), list(model.parameters()))
    wp = WeightPrediction(opt.optimizer, opt.main_params)
    src = [p.detach().clone() for p in model.parameters()]
    out = [nn.Parameter(torch.zeros_like(s)) for s in src]
    wp.predict_(out, src, 1e-2)
    assert all(torch.equal(o.data, s) for o, s in zip(out, src))


def test_fp32_prediction_keeps_two_copies_and_true_weights_recoverable():
    """2BW steps with prediction on two buffers: the optimizer's main parameters own no
    storage (they alias a buffer), and the latest buffer un-predicts to the weights a
    plain (unpredicted) optimizer reaches with the same gradients."""
    model = _model()
    bufs = WeightBuffers(model, 2)
    opt = get_megatron_optimizer(_opt_cfg(), _prec(), bufs.params(0))
    opt.enable_mitigation("predict")
    plain_model = _model()
    plain = get_megatron_optimizer(_opt_cfg(), _prec(), list(plain_model.parameters()))
    pp = list(plain_model.parameters())
    for t in range(4):
        grads_from, base = bufs.params(t % 2), bufs.params((t + 1) % 2)
        _fake_grads(grads_from, t)
        opt.step(grads_from, grads_from, base, lr=1e-2)
        _fake_grads(pp, t)
        plain.step(pp, pp, pp, lr=1e-2)
        ptrs = bufs.storage_ptrs()
        assert len(ptrs) == 2 * len(pp)
        assert all(m.untyped_storage().data_ptr() in ptrs for m in opt.main_params)
    latest = bufs.params(3 % 2)
    with opt.true_weights(latest):
        for a, b in zip(latest, pp):
            torch.testing.assert_close(a.data, b.data, rtol=1e-12, atol=1e-14)
    assert not torch.allclose(latest[0].data, pp[0].data, rtol=1e-12, atol=1e-14)


def test_bf16_buffers_hold_the_prediction_of_the_fp32_masters():
    model = _model(torch.bfloat16)
    bufs = WeightBuffers(model, 2)
    opt = get_megatron_optimizer(_opt_cfg(), _prec(half=True), bufs.params(0))
    opt.enable_mitigation("predict")
    for t in range(3):
        grads_from, base = bufs.params(t % 2), bufs.params((t + 1) % 2)
        _fake_grads(grads_from, t)
        opt.step(grads_from, grads_from, base, lr=1e-2)
    written = bufs.params(0)
    expect = [nn.Parameter(torch.empty_like(p)) for p in written]
    opt.prediction.predict_(expect, [m.data for m in opt.main_params], 1e-2)
    assert all(torch.equal(a.data, b.data) for a, b in zip(written, expect))
    with opt.true_weights(written):
        assert all(torch.equal(p.data, m.data.to(torch.bfloat16))
                   for p, m in zip(written, opt.main_params))
    assert all(torch.equal(a.data, b.data) for a, b in zip(written, expect))


def test_delay_compensation_formula():
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    old = nn.Parameter(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    new = nn.Parameter(torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64))
    grads = [g.clone()]
    delay_compensate_(grads, [old], [new], lam=0.5)
    torch.testing.assert_close(grads[0], g + 0.5 * g * g * (new.data - old.data))


def test_mitigation_flags(capsys):
    from megatron.arguments import parse_and_validate

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--train-iters", "50", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "32"]
    _, cfg = parse_and_validate(base + ["--pipeline-schedule", "2bw",
                                        "--2bw-mitigation", "warmup"])
    assert cfg.parallel.tbw_mitigation == "warmup"
    assert cfg.parallel.tbw_flush_warmup_iters == 25  # default: half of --train-iters
    with pytest.raises(SystemExit):
        parse_and_validate(base + ["--2bw-mitigation", "predict"])
    assert ("--2bw-mitigation predict needs --pipeline-schedule 2bw, got --pipeline-schedule "
            "flush") in capsys.readouterr().err


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("half", [False, True])
def test_multi_tensor_prediction_equals_the_per_parameter_loop(name, half, monkeypatch):
    """Accelerators predict (and restore) in multi-tensor chunks, the CPU one parameter
    at a time; forced onto the CPU, with chunks of a few tensors, the chunked form gives
    bit for bit what the loop gives: in place (fp32/float64) and into a half-precision
    buffer from the fp32 masters."""
    from megatron.optimizer import staleness

    dtype = torch.bfloat16 if half else torch.float64
    model = _model(dtype)
    params = list(model.parameters())
    opt = get_megatron_optimizer(_opt_cfg(name), _prec(half), params)
    for seed in range(3):
        _fake_grads(params, seed)
        opt.step(params, params, params, lr=1e-2)
    src = ([m.data for m in opt.main_params] if half
           else [p.detach().clone() for p in params])
    outs = []
    for foreach in (False, True):
        monkeypatch.setattr(staleness, "use_foreach", lambda _params, f=foreach: f)
        monkeypatch.setattr(staleness, "CHUNK_BYTES", 40)  # a few tensors per chunk
        wp = WeightPrediction(opt.optimizer, opt.main_params)
        dst = [nn.Parameter(p.detach().clone()) for p in params]
        if not half:  # in place: the buffer is its own source
            for d, s in zip(dst, src):
                d.data.copy_(s)
        wp.predict_(dst, [m.data for m in opt.main_params] if half else [d.data for d in dst],
                    7e-3)
        predicted = [d.detach().clone() for d in dst]
        if not half:
            wp.restore_(dst)
        outs.append((predicted, [d.detach().clone() for d in dst]))
    (p_loop, r_loop), (p_chunk, r_chunk) = outs
    for a, b in zip(p_loop + r_loop, p_chunk + r_chunk):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, s.to(a.dtype)) for a, s in zip(p_loop, src))  # it moved


def test_resume_warns_when_the_warm_up_switch_moves():
    """--2bw-flush-warmup-iters defaults to half of --train-iters, so resuming with a longer
    run moves the Flush -> 2BW switch: the resume says so, names the iterations that run
    under Flush again and the flag that keeps the checkpoint's switch."""
    from megatron.arguments import parse_and_validate
    from megatron.training_checkpoint import warmup_switch_note

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "32", "--pipeline-schedule", "2bw", "--2bw-mitigation", "warmup"]
    _, first = parse_and_validate(base + ["--train-iters", "1000"])
    _, longer = parse_and_validate(base + ["--train-iters", "2000"])
    _, kept = parse_and_validate(base + ["--train-iters", "2000",
                                         "--2bw-flush-warmup-iters", "500"])
    saved = first.to_dict()["parallel"]
    assert saved["tbw_flush_warmup_iters"] == 500
    note = warmup_switch_note(longer, saved, 700)
    assert note.startswith("warning: the checkpoint's run switches from Flush to 2BW at "
                           "iteration 500, this one at 1000")
    assert "iterations 700 to 999 run under Flush again" in note
    assert "pass --2bw-flush-warmup-iters 500" in note
    assert "again" not in warmup_switch_note(longer, saved, 300)  # still before both
    assert warmup_switch_note(kept, saved, 700) is None
    assert warmup_switch_note(first, saved, 700) is None
    _, plain = parse_and_validate(base[:-2] + ["--train-iters", "2000"])
    assert warmup_switch_note(plain, saved, 700) is None


def test_resume_under_another_schedule_is_noted():
    """A checkpoint may be resumed under another --pipeline-schedule; the log says so and
    what happens to the weight versions (it was silent)."""
    from megatron.arguments import parse_and_validate
    from megatron.training_checkpoint import schedule_change_note

    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1",
            "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "32", "--train-iters", "10", "--pipeline-schedule"]
    cfgs = {s: parse_and_validate(base + [s])[1] for s in ("2bw", "flush", "gpipe")}
    saved = {s: c.to_dict()["parallel"] for s, c in cfgs.items()}
    assert schedule_change_note(cfgs["2bw"], saved["2bw"]) is None
    assert "older version 2BW kept is dropped" in schedule_change_note(cfgs["flush"],
                                                                       saved["2bw"])
    assert schedule_change_note(cfgs["2bw"], saved["flush"]).startswith(
        "note: the checkpoint was trained with --pipeline-schedule flush, this run uses 2bw")
    assert "vanilla" in schedule_change_note(cfgs["gpipe"], saved["flush"])
    assert schedule_change_note(cfgs["flush"], {}) is None  # an older checkpoint's config


def test_evaluating_the_true_weights_leaves_the_prediction_bit_for_bit():
    """fp32 (main parameters are the buffer): the prediction's bits are put back after
    the true weights were used, not made again from their inversion, so a run that
    evaluates does not drift from one that does not (helper-71 found the round trip: 2 of
    these 4688 weights came back one bit off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
    bufs = WeightBuffers(model, 2)
    opt = get_megatron_optimizer(_opt_cfg(), _prec(), bufs.params(0))
    opt.enable_mitigation("predict")
    for t in range(4):
        grads_from, base = bufs.params(t % 2), bufs.params((t + 1) % 2)
        _fake_grads(grads_from, t)
        opt.step(grads_from, grads_from, base, lr=1e-2)
    latest = bufs.params(3 % 2)
    before = [p.data.clone() for p in latest]
    for _ in range(3):
        with opt.true_weights(latest):
            assert not all(torch.equal(p.data, b) for p, b in zip(latest, before))
    assert all(torch.equal(p.data, b) for p, b in zip(latest, before))

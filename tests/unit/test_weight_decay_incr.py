"""Megatron-LM's weight-decay ramp (--weight-decay-incr-style constant|linear|cosine,
--start-weight-decay, --end-weight-decay): the scheduler's values at hand-computed points,
the optimizer applying them (biases and norms stay at 0, 2BW's weight prediction), the
checkpoint state and resume, the flags' errors, and short real training runs."""
from __future__ import annotations

import contextlib
import copy
import io
import math
import re

import pytest
import torch

from megatron.arguments import build_config, parse_and_validate, parse_args, validate_args
from megatron.config import OptimizerConfig, PrecisionConfig
from megatron.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron.optimizer.param_groups import GroupLayout
from tests.arg_errors import assert_one_line_error


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sched(style="linear", start=0.01, end=0.1, steps=100, **kw):
    return OptimizerParamScheduler(1.0, 0.0, 0, 100, "constant", start_wd=start, end_wd=end,
                                   wd_incr_steps=steps, wd_incr_style=style, **kw)


# ---- the schedule ------------------------------------------------------------------------

def test_linear_ramp_at_hand_computed_points():
    s = sched("linear")
    # start + (end - start) * step / steps
    assert s.get_wd(0) == 0.01
    assert s.get_wd(25) == pytest.approx(0.01 + 0.09 * 0.25)
    assert s.get_wd(50) == pytest.approx(0.055)
    assert s.get_wd(100) == 0.1 and s.get_wd(101) == 0.1 and s.get_wd(10 ** 6) == 0.1
    for _ in range(30):  # the counter drives it
        s.step()
    assert s.get_wd() == s.get_wd(30) == pytest.approx(0.01 + 0.09 * 0.3)


def test_cosine_ramp_at_hand_computed_points():
    s = sched("cosine")
    # start + (end - start) * 0.5 * (cos(pi * (1 - ratio)) + 1): slow at both ends
    assert s.get_wd(0) == pytest.approx(0.01)
    assert s.get_wd(25) == pytest.approx(0.01 + 0.09 * 0.5 * (math.cos(0.75 * math.pi) + 1))
    assert s.get_wd(50) == pytest.approx(0.055)  # half way: cos(pi/2) = 0
    assert s.get_wd(75) == pytest.approx(0.01 + 0.09 * 0.5 * (math.cos(0.25 * math.pi) + 1))
    assert s.get_wd(100) == 0.1 and s.get_wd(500) == 0.1
    assert s.get_wd(10) < sched("linear").get_wd(10)  # below the line early on


def test_constant_and_no_schedule():
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.05, lr_decay_style="constant")
    s = OptimizerParamScheduler.from_config(cfg, train_iters=20)
    assert (s.start_wd, s.end_wd, s.wd_incr_style) == (0.05, 0.05, "constant")
    assert [s.get_wd(k) for k in (0, 10, 20, 1000)] == [0.05] * 4
    # a scheduler built without one (evaluation only): the groups keep their own
    assert OptimizerParamScheduler(1.0, 0.0, 0, 1, "constant").get_wd() is None


def test_from_config_in_iterations_and_samples():
    cfg = OptimizerConfig(lr=1e-3, lr_decay_style="constant", start_weight_decay=0.0,
                          end_weight_decay=0.2, weight_decay_incr_style="linear")
    s = OptimizerParamScheduler.from_config(cfg, train_iters=40)
    assert (s.wd_incr_steps, s.get_wd(10)) == (40, pytest.approx(0.05))
    samples = OptimizerConfig(lr=1e-3, lr_decay_style="constant", start_weight_decay=0.0,
                              end_weight_decay=0.2, weight_decay_incr_style="linear",
                              lr_schedule_unit="samples", lr_warmup_samples=0,
                              lr_decay_samples=320, wd_incr_samples=320)
    t = OptimizerParamScheduler.from_config(samples, train_iters=40)
    assert t.wd_incr_steps == 320
    t.step_batch(8)  # one batch of 8 samples
    assert t.get_wd() == pytest.approx(0.2 * 8 / 320)


@pytest.mark.parametrize("kw,match", [
    (dict(style="linear", steps=None), "needs the length of its ramp"),
    (dict(style="cosine", start=0.2, end=0.1), "0 <= start_wd <= end_wd"),
    (dict(style="linear", start=-0.1), "0 <= start_wd <= end_wd"),
    (dict(style="constant"), "constant needs start_wd == end_wd"),
    (dict(style="linear", end=None), "needs both start_wd and end_wd"),
    (dict(style="square"), "--weight-decay-incr-style must be one of"),
])
def test_scheduler_refuses_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        sched(**kw)


# ---- the optimizer applies it ------------------------------------------------------------

def small_params(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(4, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=dtype))]


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def run(params, wds=None, steps=4, opt=None, start=0, cfg=None):
    """``steps`` updates at lr 1e-2; ``wds``: the provider's value of each step."""
    opt = opt or get_megatron_optimizer(cfg or OptimizerConfig(weight_decay=0.01),
                                        PrecisionConfig(), params)
    for k in range(steps):
        if wds is not None:
            opt.weight_decay_provider = (lambda v: lambda: v)(wds[k])
        set_grads(params, start + k)
        assert not opt.step(params, params, params, 1e-2).skipped
    return opt


def test_groups_take_the_scheduled_value_and_no_decay_groups_stay_zero():
    params = small_params()
    opt = run(params, wds=[0.0, 0.1, 0.2, 0.3])
    by_param = {i: g["weight_decay"] for ids, g in zip(opt.layout.members,
                                                       opt.optimizer.param_groups) for i in ids}
    assert by_param == {0: 0.3, 1: 0.0, 2: 0.3}
    assert GroupLayout.build(params, 0.01).wd_mult == [1.0, 0.0]
    assert GroupLayout.plain([[0], [1]], [0.1, 0.0]).wd_mults == [1.0, 0.0]


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_each_step_decays_with_its_own_value(name):
    """Against torch's optimizer with the value set on the group by hand."""
    wds = [0.0, 0.1, 0.2, 0.3]
    params = small_params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    run(params, wds, cfg=OptimizerConfig(optimizer=name, weight_decay=0.01, clip_grad=0.0))
    groups = [{"params": [ref[0], ref[2]], "weight_decay": 0.0},
              {"params": [ref[1]], "weight_decay": 0.0}]
    torch_opt = (torch.optim.AdamW(groups, lr=1e-2, fused=True) if name == "adam"
                 else torch.optim.SGD(groups, lr=1e-2, momentum=0.9))
    for k, wd in enumerate(wds):
        set_grads(ref, k)
        torch_opt.param_groups[0]["weight_decay"] = wd
        torch_opt.step()
    for a, b in zip(params, ref):
        assert torch.equal(a, b)


def test_constant_provider_gives_the_same_bits_as_none():
    plain, const = small_params(torch.float32), small_params(torch.float32)
    run(plain)
    run(const, wds=[0.01] * 4)
    for a, b in zip(plain, const):
        assert torch.equal(a, b)


def true_weights(opt, params):
    with opt.true_weights(params):
        return [p.detach().clone() for p in params]


def test_weight_prediction_inverts_with_the_decay_it_predicted_with():
    """--2bw-mitigation predict without fp32 masters: the buffer holds P(W), and the
    next step recovers W with the weight decay P was made with, not the new one; also
    across a resume (the groups torch reloads are new dicts)."""
    wds = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    plain = small_params()
    run(plain, wds, steps=6)
    predicted = small_params()
    opt = get_megatron_optimizer(OptimizerConfig(weight_decay=0.01), PrecisionConfig(),
                                 predicted)
    opt.enable_mitigation("predict")
    run(predicted, wds, steps=6, opt=opt)
    for a, b in zip(plain, true_weights(opt, predicted)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # stop after 3 steps, resume from the state (the buffer holds predicted weights)
    first = small_params()
    opt = get_megatron_optimizer(OptimizerConfig(weight_decay=0.01), PrecisionConfig(), first)
    opt.enable_mitigation("predict")
    sd = copy.deepcopy(run(first, wds[:3], steps=3, opt=opt).state_dict())
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = get_megatron_optimizer(OptimizerConfig(weight_decay=0.01), PrecisionConfig(), second)
    opt.enable_mitigation("predict")
    opt.load_state_dict(sd)
    run(second, wds[3:], steps=3, opt=opt, start=3)
    for a, b in zip(plain, true_weights(opt, second)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ---- checkpoint state ----------------------------------------------------------------------

def test_state_round_trip_continues_the_ramp():
    s = sched("cosine")
    for _ in range(40):
        s.step()
    sd = s.state_dict()
    assert (sd["start_wd"], sd["end_wd"], sd["wd_incr_steps"], sd["wd_incr_style"]) == (
        0.01, 0.1, 100, "cosine")
    t = sched("cosine")
    t.load_state_dict(sd)
    assert t.num_steps == 40 and t.get_wd() == s.get_wd()


def test_mismatch_on_resume_follows_the_lr_schedule_rules():
    sd = sched("linear").state_dict()
    with pytest.raises(ValueError, match=r"checkpoint has end_wd=0\.1 but this run has "
                                         r"end_wd=0\.2 .*pass --override-opt_param-scheduler"):
        sched("linear", end=0.2).load_state_dict(sd)
    with pytest.raises(ValueError, match="wd_incr_style='linear' but this run has "
                                         "wd_incr_style='cosine'"):
        sched("cosine").load_state_dict(sd)
    with pytest.raises(ValueError, match=r"wd_incr_steps=100 but this run has "
                                         r"wd_incr_steps=200 \(iterations\)"):
        sched("linear", steps=200).load_state_dict(sd)
    ours = sched("linear", end=0.2)
    ours.load_state_dict(sd, override=True)
    assert ours.end_wd == 0.2
    ours.load_state_dict(sd, use_checkpoint=True)
    assert ours.end_wd == 0.1
    # constant on both sides: the run's length means nothing, its value does
    const = sched("constant", start=0.05, end=0.05).state_dict()
    sched("constant", start=0.05, end=0.05, steps=300).load_state_dict(const)
    with pytest.raises(ValueError, match="start_wd=0.05 but this run has start_wd=0.01"):
        sched("constant", start=0.01, end=0.01).load_state_dict(const)


def test_a_state_saved_before_the_ramp_loads():
    old = sched("constant", start=0.05, end=0.05).state_dict()
    for key in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"):
        old.pop(key)
    old["num_steps"] = 30
    for style, start in (("constant", 0.01), ("linear", 0.0)):
        for kw in ({}, {"use_checkpoint": True}, {"override": True}):
            s = sched(style, start=start, end=0.01 if style == "constant" else 0.1)
            s.load_state_dict(old, **kw)  # it records no weight decay: this run's applies
            assert s.num_steps == 30 and s.wd_incr_style == style and s.start_wd == start


def test_units_convert_on_load():
    it = sched("linear", steps=100).state_dict()
    sched("linear", steps=800, unit="samples").load_state_dict(it, samples_per_iteration=8)
    with pytest.raises(ValueError, match=r"wd_incr_steps=800 but this run has "
                                         r"wd_incr_steps=960 \(samples\)"):
        sched("linear", steps=960, unit="samples").load_state_dict(it, samples_per_iteration=8)
    taken = sched("linear", steps=960, unit="samples")
    taken.load_state_dict(it, samples_per_iteration=8, use_checkpoint=True)
    assert taken.wd_incr_steps == 800


# ---- the flags -----------------------------------------------------------------------------

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def test_flags_reach_the_config():
    o = build_config(validate_args(parse_args(BASE + [
        "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0",
        "--end-weight-decay", "0.1"]), 1)).optimizer
    assert (o.start_weight_decay, o.end_weight_decay, o.weight_decay_incr_style) == (
        0.0, 0.1, "cosine")
    s = OptimizerParamScheduler.from_config(o, train_iters=10)
    assert (s.wd_incr_steps, s.get_wd(5)) == (10, pytest.approx(0.05))
    o = build_config(validate_args(parse_args(BASE), 1)).optimizer
    assert (o.start_weight_decay, o.end_weight_decay, o.weight_decay_incr_style) == (
        None, None, "constant")
    # constant with start and end equal to --weight-decay is accepted
    validate_args(parse_args(BASE + ["--weight-decay", "0.1", "--start-weight-decay", "0.1",
                                     "--end-weight-decay", "0.1"]), 1)
    samples = [a if a != "--train-iters" else "--train-samples" for a in BASE]
    samples[samples.index("--train-samples") + 1] = "40"
    o = build_config(validate_args(parse_args(samples + [
        "--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
        "--end-weight-decay", "0.1"]), 1)).optimizer
    assert (o.lr_schedule_unit, o.wd_incr_samples) == ("samples", 40)


@pytest.mark.parametrize("extra,expected", [
    (["--weight-decay-incr-style", "linear"],
     "--weight-decay-incr-style linear needs --start-weight-decay and --end-weight-decay"),
    (["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.1"],
     "--weight-decay-incr-style cosine needs --end-weight-decay"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2",
      "--end-weight-decay", "0.1"],
     "--start-weight-decay (0.2) must be <= --end-weight-decay (0.1)"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay=-0.1",
      "--end-weight-decay", "0.1"], "--start-weight-decay must be >= 0, got -0.1"),
    (["--start-weight-decay", "0.1"],
     "--start-weight-decay (0.1) must equal --weight-decay (0.01) with "
     "--weight-decay-incr-style constant"),
    (["--weight-decay", "0.1", "--end-weight-decay", "0"],
     "--end-weight-decay (0.0) must equal --weight-decay (0.1)"),
])
def test_bad_combinations_are_one_line_errors(extra, expected, capsys, monkeypatch):
    assert_one_line_error(BASE + extra, expected, capsys, monkeypatch)


def test_an_unknown_style_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        parse_and_validate(BASE + ["--weight-decay-incr-style", "square"])
    assert exit_info.value.code == 2
    assert "--weight-decay-incr-style" in capsys.readouterr().err


# ---- short real training runs ----------------------------------------------------------------

RAMP = ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0",
        "--end-weight-decay", "0.1"]


def train(monkeypatch, *extra):
    """Train TINY for 4 iterations in this process; returns (losses, the optimizer, the
    scheduler, stdout)."""
    import pretrain_gpt
    from megatron import training
    from tests.distributed.gpt_harness import TINY

    made = {}
    setup = training.setup_model_and_optimizer

    def capture(*args, **kw):
        model, opt, scheduler, engine = setup(*args, **kw)
        made.update(optimizer=opt, scheduler=scheduler)
        return model, opt, scheduler, engine

    monkeypatch.setattr(training, "setup_model_and_optimizer", capture)
    out = io.StringIO()
    torch.manual_seed(0)
    with contextlib.redirect_stdout(out):
        result = training.pretrain(
            pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
            pretrain_gpt.forward_step,
            argv=TINY + ["--train-iters", "4", "--eval-iters", "0", "--log-interval", "1",
                         *extra])
    losses = [result.losses[k]["lm loss"] for k in sorted(result.losses)]
    return losses, made["optimizer"], made["scheduler"], out.getvalue()


def test_training_applies_the_ramp(monkeypatch):
    losses, opt, scheduler, log = train(monkeypatch, *RAMP)
    # the 4th (last) update used the value at step 3 of 4: 0.1 * 3 / 4
    wds = [g["weight_decay"] for g in opt.optimizer.param_groups]
    decayed = [m for m in opt.layout.wd_mult]
    assert sorted(set(decayed)) == [0.0, 1.0]
    assert wds == [pytest.approx(0.075) if m else 0.0 for m in decayed]
    assert scheduler.num_steps == 4 and scheduler.get_wd() == pytest.approx(0.1)
    printed = [float(v) for v in re.findall(r"weight decay: ([0-9.E+-]+) \|", log)]
    assert printed == pytest.approx([0.0, 0.025, 0.05, 0.075])
    # a constant weight decay given as start == end == --weight-decay: the same bits as
    # no flag at all (and no weight decay on the log line)
    plain, _, _, plain_log = train(monkeypatch)
    same, _, _, _ = train(monkeypatch, "--start-weight-decay", "0.01", "--end-weight-decay",
                          "0.01", "--weight-decay-incr-style", "constant")
    assert same == plain and losses != plain
    assert "weight decay" not in plain_log

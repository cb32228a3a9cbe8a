"""--decoupled-lr / --decoupled-min-lr (Megatron-LM's): the input and output layers on a
schedule of their own shape-alike, which parameters those are on every pipeline stage,
the optimizer's groups and checkpoint format, resume and the flags' errors.  No process
group: the multi-rank checks are in tests/distributed/test_decoupled_lr_training.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron.arguments import build_config, parse_args, validate_args
from megatron.config import ModelConfig, OptimizerConfig, PrecisionConfig
from megatron.model import BertModel, GPTModel, stage_layer_numbers
from megatron.optimizer import OptimizerParamScheduler, get_megatron_optimizer
from megatron.optimizer.param_groups import GroupLayout, is_embedding_or_output
from megatron.tensor_parallel import TPInfo
from tests.arg_errors import assert_one_line_error


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


# ---- the schedule ------------------------------------------------------------------------

def sched(style, dlr=2.0, dmin=0.5, **kw):
    base = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style=style,
                decoupled_lr=dlr, decoupled_min_lr=dmin)
    base.update(kw)
    return OptimizerParamScheduler(**base)


def test_both_schedules_at_hand_computed_points():
    s = sched("linear")
    # warmup: both rise linearly from 0
    assert (s.get_lr(5), s.get_decoupled_lr(5)) == pytest.approx((0.5, 1.0))
    # ratio (35 - 10) / 100 = 0.25: min + 0.75 (max - min)
    assert s.get_lr(35) == pytest.approx(0.1 + 0.75 * 0.9)
    assert s.get_decoupled_lr(35) == pytest.approx(0.5 + 0.75 * 1.5)
    assert (s.get_lr(500), s.get_decoupled_lr(500)) == (0.1, 0.5)
    c = sched("cosine")
    assert c.get_decoupled_lr(60) == pytest.approx(1.25)  # half way: (2.0 + 0.5) / 2
    inv = sched("inverse-square-root", dmin=0.3)
    assert inv.get_decoupled_lr(40) == pytest.approx(2.0 * math.sqrt(10 / 40))
    assert inv.get_decoupled_lr(10 ** 6) == 0.3  # never below its floor
    wsd = sched("WSD", wsd_decay_steps=20, wsd_decay_style="linear")
    assert (wsd.get_lr(90), wsd.get_decoupled_lr(90)) == (1.0, 2.0)  # stable until 90
    assert wsd.get_decoupled_lr(100) == pytest.approx(0.5 + 0.5 * 1.5)  # half the anneal
    const = sched("constant")
    assert (const.get_lr(50), const.get_decoupled_lr(50)) == (1.0, 2.0)
    # the counter drives both
    for _ in range(35):
        s.step()
    assert s.get_decoupled_lr() == s.get_decoupled_lr(35)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_regular_rate_is_unchanged_and_floor_defaults_to_min_lr(style):
    kw = dict(wsd_decay_steps=30) if style == "WSD" else {}
    plain = OptimizerParamScheduler(1e-3, 1e-5, 10, 110, style, **kw)
    dec = OptimizerParamScheduler(1e-3, 1e-5, 10, 110, style, decoupled_lr=3e-3, **kw)
    assert dec.decoupled_min_lr == 1e-5
    steps = range(0, 130, 7)
    assert [dec.get_lr(k) for k in steps] == [plain.get_lr(k) for k in steps]
    # without --decoupled-lr the input and output layers follow --lr
    assert [plain.get_decoupled_lr(k) for k in steps] == [plain.get_lr(k) for k in steps]
    if style != "constant":
        assert dec.get_decoupled_lr(10 ** 6) == 1e-5


def test_from_config_and_samples_unit():
    cfg = OptimizerConfig(lr=1e-3, min_lr=0.0, decoupled_lr=4e-3, decoupled_min_lr=1e-4,
                          lr_warmup_iters=2, lr_decay_style="linear")
    s = OptimizerParamScheduler.from_config(cfg, train_iters=12)
    assert (s.decoupled_lr, s.decoupled_min_lr) == (4e-3, 1e-4)
    assert s.get_decoupled_lr(7) == pytest.approx(1e-4 + 0.5 * 3.9e-3)
    samples = OptimizerConfig(lr=1e-3, decoupled_lr=2e-3, lr_schedule_unit="samples",
                              lr_warmup_samples=16, lr_decay_samples=96)
    t = OptimizerParamScheduler.from_config(samples, train_iters=None)
    assert t.get_decoupled_lr(8) == pytest.approx(1e-3)


# ---- resume: the scheduler -----------------------------------------------------------------

def test_scheduler_state_round_trip_and_mismatch_names_the_field():
    s = sched("linear")
    for _ in range(40):
        s.step()
    sd = s.state_dict()
    assert (sd["decoupled_lr"], sd["decoupled_min_lr"]) == (2.0, 0.5)
    t = sched("linear")
    t.load_state_dict(sd)
    assert t.num_steps == 40 and t.get_decoupled_lr() == s.get_decoupled_lr()
    other = sched("linear", dlr=3.0)
    with pytest.raises(ValueError, match=r"checkpoint has decoupled_lr=2\.0 but this run has "
                                         r"decoupled_lr=3\.0; pass --override-opt_param"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="decoupled_min_lr=0.5"):
        sched("linear", dmin=0.2).load_state_dict(sd)
    other.load_state_dict(sd, override=True)
    assert other.decoupled_lr == 3.0 and other.num_steps == 40
    other.load_state_dict(sd, use_checkpoint=True)
    assert other.decoupled_lr == 2.0


def test_old_scheduler_state_without_the_new_fields_loads():
    plain = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear")
    old = plain.state_dict()
    assert "decoupled_lr" not in old  # a run without the flag writes what it wrote before
    for key in ("wsd_decay_steps", "wsd_decay_style"):  # and older still: before WSD
        old.pop(key)
    old["num_steps"] = 20
    again = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear")
    again.load_state_dict(old)
    assert again.num_steps == 20
    # adding --decoupled-lr to a run that had none: the usual error, or Megatron's flags
    dec = sched("linear")
    with pytest.raises(ValueError, match="checkpoint has decoupled_lr=None but this run has "
                                         "decoupled_lr=2.0"):
        dec.load_state_dict(old)
    dec.load_state_dict(old, override=True)
    assert dec.get_decoupled_lr(20) == sched("linear").get_decoupled_lr(20)
    dec.load_state_dict(old, use_checkpoint=True)  # the checkpoint's: one schedule for all
    assert dec.decoupled_lr is None and dec.get_decoupled_lr(20) == dec.get_lr(20)


def test_taking_a_decoupled_schedule_needs_the_flag():
    """--use-checkpoint-opt_param-scheduler on a checkpoint with a decoupled rate, in a
    run without --decoupled-lr: no parameter group has that rate (the groups follow this
    run's flags), so the error says which flags take it."""
    s = sched("linear")
    s.num_steps = 30
    sd = s.state_dict()
    plain = OptimizerParamScheduler(1.0, 0.1, 10, 110, "linear")
    with pytest.raises(ValueError, match=r"decoupled_lr=2\.0 but this run has no "
                                         r"--decoupled-lr.*pass --decoupled-lr 2\.0 "
                                         r"--decoupled-min-lr 0\.5$"):
        plain.load_state_dict(sd, use_checkpoint=True)
    plain.load_state_dict(sd, override=True)   # keeping this run's schedule is fine
    assert plain.decoupled_lr is None and plain.num_steps == 30
    sched("linear", dlr=3.0).load_state_dict(sd, use_checkpoint=True)   # with the flag


# ---- which parameters ------------------------------------------------------------------------

def gpt_config(tied: bool, **kw) -> ModelConfig:
    base = dict(num_layers=3, hidden_size=16, num_attention_heads=4, seq_length=8,
                padded_vocab_size=32, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.float32, untie_embeddings_and_output_weights=not tied)
    base.update(kw)
    return ModelConfig(**base)


def gpt_stage(cfg: ModelConfig, pp: int, rank: int, tp: TPInfo = TPInfo.single(), seed=3):
    return GPTModel(cfg, tp, pre_process=rank == 0, post_process=rank == pp - 1,
                    layer_numbers=stage_layer_numbers(cfg.num_layers, pp, rank), seed=seed)


def decoupled_names(model, decoupled_lr=2e-3):
    """Names of the parameters the optimizer puts in decoupled groups."""
    params = list(model.parameters())
    opt = get_megatron_optimizer(opt_cfg(decoupled_lr=decoupled_lr), PrecisionConfig(), params)
    names = [n for n, _ in model.named_parameters()]
    return {names[i] for ids, flag in zip(opt.layout.members, opt.layout.decoupled)
            if flag for i in ids}


def opt_cfg(**kw) -> OptimizerConfig:
    base = dict(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


WORD, OUT, COPY = ("embedding.word_embeddings.weight", "output_layer.weight",
                   "output_word_embeddings.weight")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [TPInfo.single(), TPInfo(group=object(), size=2, rank=1)],
                         ids=["tp1", "tp2-rank1"])
def test_gpt_stages_decouple_the_word_embedding_and_output_weight(tied, tp):
    cfg = gpt_config(tied)
    # one stage: tied -> the word embedding is also the output layer
    assert decoupled_names(gpt_stage(cfg, 1, 0, tp)) == ({WORD} if tied else {WORD, OUT})
    first, middle, last = (gpt_stage(cfg, 3, r, tp) for r in range(3))
    assert decoupled_names(first) == {WORD}  # not the position embedding
    assert decoupled_names(middle) == set()
    assert decoupled_names(last) == ({COPY} if tied else {OUT})
    # without the flag nothing is decoupled, whatever the attribute says
    assert decoupled_names(last, decoupled_lr=None) == set()


def test_bert_stages_decouple_the_word_embedding_and_its_last_stage_copy():
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8,
                      padded_vocab_size=32, num_tokentypes=2, params_dtype=torch.float32)
    whole = BertModel(cfg, TPInfo.single())
    assert decoupled_names(whole) == {WORD}  # not the LM head's bias, dense or norm
    first = BertModel(cfg, TPInfo.single(), post_process=False, layer_numbers=range(0, 1))
    last = BertModel(cfg, TPInfo.single(), pre_process=False, layer_numbers=range(1, 2))
    assert decoupled_names(first) == {WORD}
    assert decoupled_names(last) == {COPY}


@pytest.mark.parametrize("tied", [True, False])
def test_weight_decay_of_every_parameter_is_unchanged(tied):
    model = gpt_stage(gpt_config(tied), 1, 0)
    params = list(model.parameters())

    def decay_of(cfg):
        opt = get_megatron_optimizer(cfg, PrecisionConfig(), params)
        return {i: g["weight_decay"] for ids, g in zip(opt.layout.members,
                                                       opt.optimizer.param_groups) for i in ids}

    assert decay_of(opt_cfg(decoupled_lr=5e-3)) == decay_of(opt_cfg())
    layout = GroupLayout.build(params, 0.1, decoupled_lr=True)
    # the runs keep model order inside each weight-decay group: torch numbers alike
    plain = GroupLayout.build(params, 0.1)
    assert [i for g in layout.members for i in g] == [i for g in plain.members for i in g]
    assert len(plain.members) == 2 and layout.saved[-1] == 1


# ---- the optimizer step ----------------------------------------------------------------------

def grads_for(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def run_steps(model, cfg, prec, lrs, start=0, opt=None, dlrs=None):
    params = list(model.parameters())
    opt = opt or get_megatron_optimizer(cfg, prec, params)
    for k, lr in enumerate(lrs):
        for p, g in zip(params, grads_for(params, start + k)):
            p.grad = g
        info = opt.step(params, params, params, lr,
                        decoupled_lr=None if dlrs is None else dlrs[k])
        assert not info.skipped
    return opt


LRS = [1e-3, 8e-4, 5e-4]


@pytest.mark.parametrize("name", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoupled_lr_equal_to_lr_gives_the_same_bits(name, dtype):
    cfg = gpt_config(tied=False, params_dtype=dtype)
    prec = PrecisionConfig(bf16=dtype == torch.bfloat16)
    plain, dec = gpt_stage(cfg, 1, 0), gpt_stage(cfg, 1, 0)
    run_steps(plain, opt_cfg(optimizer=name), prec, LRS)
    opt = run_steps(dec, opt_cfg(optimizer=name, decoupled_lr=1e-3), prec, LRS, dlrs=LRS)
    assert opt.layout.any_decoupled
    for (n, a), b in zip(plain.named_parameters(), dec.parameters()):
        assert torch.equal(a, b), n


def test_decoupled_parameters_take_their_own_rate():
    """Against torch's AdamW with the same groups, one rate each (bit for bit)."""
    model = gpt_stage(gpt_config(tied=False), 1, 0)
    ref = copy.deepcopy(model)
    dlrs = [3e-3, 2e-3, 1e-3]
    run_steps(model, opt_cfg(decoupled_lr=3e-3), PrecisionConfig(), LRS, dlrs=dlrs)
    params = list(ref.parameters())
    flags = [is_embedding_or_output(p) for p in model.parameters()]  # deepcopy drops it
    assert sum(flags) == 2
    groups = []
    for wd, want_2d in ((0.1, True), (0.0, False)):
        for flag in (True, False):
            ps = [p for p, f in zip(params, flags) if (p.ndim >= 2) == want_2d and f == flag]
            if ps:
                groups.append({"params": ps, "weight_decay": wd, "dec": flag})
    torch_opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    for k in range(3):
        for p, g in zip(params, grads_for(params, k)):
            p.grad = g
        for group in torch_opt.param_groups:
            group["lr"] = dlrs[k] if group["dec"] else LRS[k]
        torch_opt.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n


def test_a_step_without_the_decoupled_rate_is_an_error():
    model = gpt_stage(gpt_config(tied=True), 1, 0)
    params = list(model.parameters())
    opt = get_megatron_optimizer(opt_cfg(decoupled_lr=2e-3), PrecisionConfig(), params)
    for p in params:
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="decoupled_lr_provider"):
        opt.step(params, params, params, 1e-3)
    opt.decoupled_lr_provider = lambda: 2e-3  # as the trainer sets it
    assert not opt.step(params, params, params, 1e-3).skipped


# ---- resume: the optimizer state -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_resume_is_exact_and_the_checkpoint_format_is_unchanged(dtype):
    cfg = gpt_config(tied=False, params_dtype=dtype)
    prec = PrecisionConfig(bf16=dtype == torch.bfloat16)
    dcfg = opt_cfg(decoupled_lr=3e-3)
    lrs, dlrs = [1e-3, 8e-4, 6e-4, 4e-4], [3e-3, 2e-3, 1e-3, 5e-4]
    full = gpt_stage(cfg, 1, 0)
    run_steps(full, dcfg, prec, lrs, dlrs=dlrs)
    half = gpt_stage(cfg, 1, 0)
    sd = copy.deepcopy(run_steps(half, dcfg, prec, lrs[:2], dlrs=dlrs[:2]).state_dict())
    # the (decay, no-decay) groups a run without the flag writes
    plain_sd = run_steps(gpt_stage(cfg, 1, 0), opt_cfg(), prec, lrs[:2]).state_dict()
    assert [len(g["params"]) for g in sd["optimizer"]["param_groups"]] == [
        len(g["params"]) for g in plain_sd["optimizer"]["param_groups"]]
    assert sorted(sd["optimizer"]["state"]) == sorted(plain_sd["optimizer"]["state"])
    resumed = gpt_stage(cfg, 1, 0)
    with torch.no_grad():
        for a, b in zip(resumed.parameters(), half.parameters()):
            a.copy_(b)
    opt = get_megatron_optimizer(dcfg, prec, list(resumed.parameters()))
    opt.load_state_dict(sd)
    run_steps(resumed, dcfg, prec, lrs[2:], start=2, opt=opt, dlrs=dlrs[2:])
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_a_checkpoint_without_the_flag_resumes_with_it_and_back():
    """The optimizer state of a run without --decoupled-lr (or written before it existed)
    loads into a run with it, and the other way round: moments land on the same
    parameters, so --decoupled-lr equal to --lr continues to the same bits."""
    cfg = gpt_config(tied=True)
    prec = PrecisionConfig()
    full = gpt_stage(cfg, 1, 0)
    run_steps(full, opt_cfg(), prec, LRS)
    for first, second in ((opt_cfg(), opt_cfg(decoupled_lr=1e-3)),
                          (opt_cfg(decoupled_lr=1e-3), opt_cfg())):
        model = gpt_stage(cfg, 1, 0)
        sd = copy.deepcopy(run_steps(model, first, prec, LRS[:1], dlrs=LRS[:1]
                                     if first.decoupled_lr else None).state_dict())
        opt = get_megatron_optimizer(second, prec, list(model.parameters()))
        opt.load_state_dict(sd)
        run_steps(model, second, prec, LRS[1:], start=1, opt=opt,
                  dlrs=LRS[1:] if second.decoupled_lr else None)
        for (n, a), b in zip(full.named_parameters(), model.parameters()):
            assert torch.equal(a, b), n


def test_weight_prediction_uses_each_groups_rate():
    """--2bw-mitigation predict: the decoupled parameters are predicted with their own
    rate, and the true weights come back from the buffer (fp32, no masters)."""
    from megatron.optimizer.staleness import WeightPrediction

    model = gpt_stage(gpt_config(tied=False), 1, 0)
    params = list(model.parameters())
    opt = run_steps(model, opt_cfg(decoupled_lr=3e-3), PrecisionConfig(), LRS[:2],
                    dlrs=[3e-3, 2e-3])
    flags = [is_embedding_or_output(p) for p in params]
    wp = WeightPrediction(opt.optimizer, opt.main_params, decoupled=flags)
    src = [p.detach().clone() for p in params]
    both = [torch.empty_like(p) for p in params]
    wp.predict_(both, src, 1e-3, 5e-3)
    alone = WeightPrediction(opt.optimizer, opt.main_params)
    for lr, want in ((1e-3, False), (5e-3, True)):
        out = [torch.empty_like(p) for p in params]
        alone.predict_(out, src, lr)
        for o, b, f in zip(out, both, flags):
            if f == want:
                assert torch.equal(o, b)
    restored = [b.clone() for b in both]
    wp.restore_(restored)
    for r, s in zip(restored, src):
        torch.testing.assert_close(r, s, rtol=1e-5, atol=1e-6)
    assert wp.state_dict()["last_decoupled_lr"] == 5e-3
    assert "last_decoupled_lr" not in alone.state_dict()  # as before the flag


# ---- the flags ---------------------------------------------------------------------------------

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
        "--lr", "1e-3", "--mock-data", "--vocab-size", "128"]


def test_flags_reach_the_config():
    o = build_config(validate_args(parse_args(BASE + ["--decoupled-lr", "5e-3",
                                                      "--decoupled-min-lr", "1e-5"]), 1)).optimizer
    assert (o.decoupled_lr, o.decoupled_min_lr) == (5e-3, 1e-5)
    o = build_config(validate_args(parse_args(BASE), 1)).optimizer
    assert (o.decoupled_lr, o.decoupled_min_lr) == (None, None)


@pytest.mark.parametrize("extra,expected", [
    (["--decoupled-lr=-1e-3"], "--decoupled-lr must be >= 0, got -0.001"),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "-1"],
     "--decoupled-min-lr must be >= 0, got -1.0"),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "2e-3"],
     "--decoupled-min-lr (0.002) must be <= --decoupled-lr (0.001)"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--min-lr", "1e-4", "--decoupled-lr", "1e-5"],
     "--decoupled-lr (1e-05) must be >= its floor, --min-lr (0.0001)"),
])
def test_bad_values_are_one_line_errors(extra, expected, capsys, monkeypatch):
    assert_one_line_error(BASE + extra, expected, capsys, monkeypatch)


# ---- on two gloo ranks: both ends of the tied embedding, the distributed optimizer ----------

def test_pipeline_and_distributed_optimizer_runs(tmp_path):
    """Two ranks, float64 tiny GPT.  pp=2 (2BW, tied embeddings): the first stage's word
    embedding and the last stage's copy take the same decoupled updates and stay equal;
    --decoupled-lr equal to --lr trains to the same bits as no flag.  dp=2 with
    --use-distributed-optimizer (the decoupled groups cut into pieces) trains to the
    same bits as plain data parallelism and resumes from its checkpoint exactly."""
    from tests.dist_utils import run_distributed
    from tests.distributed.gpt_harness import TINY, train_configs

    base = TINY + ["--lr-decay-style", "linear", "--min-lr", "1e-4", "--clip-grad", "0",
                   "--eval-iters", "0"]
    pp = base + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw"]
    dp = base + ["--decoupled-lr", "4e-3", "--decoupled-min-lr", "2e-4"]
    ckpt = str(tmp_path / "ckpt")
    configs = [("pp_plain", pp, None),
               ("pp_same", pp + ["--decoupled-lr", "1e-3"], None),
               ("pp_dec", pp + ["--decoupled-lr", "5e-3"], None),
               ("dp_plain", dp, None),
               ("dp_dist", dp + ["--use-distributed-optimizer"], None),
               ("first", dp + ["--use-distributed-optimizer", "--save", ckpt,
                               "--exit-interval", "2"], None),
               ("second", dp + ["--use-distributed-optimizer", "--load", ckpt], None)]
    ranks = run_distributed(train_configs, 2, args=(configs,), timeout=120)
    last = ranks[-1]
    assert last["pp_same"]["losses"] == last["pp_plain"]["losses"]
    assert last["pp_dec"]["losses"][4] != last["pp_plain"]["losses"][4]
    first_copy, last_copy = (r["pp_dec"]["shared_embedding"] for r in ranks)
    assert torch.equal(first_copy, last_copy)
    assert not torch.equal(first_copy, ranks[0]["pp_plain"]["shared_embedding"])
    assert last["dp_dist"]["losses"] == last["dp_plain"]["losses"]
    assert last["first"]["iteration"] == 2 and sorted(last["second"]["losses"]) == [3, 4]
    for t in (3, 4):
        assert last["second"]["losses"][t] == last["dp_plain"]["losses"][t]


def test_log_line_prints_the_decoupled_rate_after_the_regular_one():
    """As Megatron-LM: 'learning rate: X | decoupled learning rate: Y |', Y the input and
    output layers' rate of the same step (linear decay from 5e-3 here, from 1e-3 for the
    rest); without the flag the line has no such field."""
    import contextlib
    import io
    import re

    import pretrain_gpt
    from megatron.training import pretrain
    from tests.distributed.gpt_harness import TINY

    def rates(*extra):
        out = io.StringIO()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with contextlib.redirect_stdout(out):
                pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider,
                         pretrain_gpt.forward_step,
                         argv=TINY + ["--train-iters", "4", "--log-interval", "1",
                                      "--eval-iters", "0", "--lr-decay-style", "linear",
                                      *extra])
        finally:
            torch.set_num_threads(threads)
        return [(float(a), float(b) if b else None) for a, b in re.findall(
            r"learning rate: ([0-9.E+-]+) \|(?: decoupled learning rate: ([0-9.E+-]+) \|)?",
            out.getvalue())]

    got = rates("--decoupled-lr", "5e-3")
    assert [lr for lr, _ in got] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert [d for _, d in got] == pytest.approx([5e-3, 3.75e-3, 2.5e-3, 1.25e-3])
    assert all(d is None for _, d in rates())

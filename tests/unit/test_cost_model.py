"""Closed-form cost functions of the planner against hand-computed cases.

Every expected value here is written out from the formulas (paper Appendix A, Megatron's
FLOP count, Korthikanti's activation count), not by calling the module's helpers.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from megatron.pipeline.planner import Config, CostModel, CostOptions, HardwareSpec, ModelSpec
from megatron.pipeline.planner.hardware import (describe_links, placement_links,
                                                ring_allreduce_time)

GiB = 2.0 ** 30

# A toy GPT: 8 layers, h=64, 4 heads, s=32, vocab 100, with the explicit softmax
# (--attention-backend local), whose activations are Korthikanti's count.
L, H, A, S, V = 8, 64, 4, 32, 100
TOY = ModelSpec(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V,
                attention_backend="local")
# Plain hardware: no efficiency curve, no elementwise term, one server of 8.
PLAIN = HardwareSpec(name="plain", gpus_per_server=8, gpu_memory_bytes=16 * GiB, peak_flops=1e12,
                     achieved_flops=1e12, intra_server_bandwidth=1e11,
                     inter_server_bandwidth=1e9, reserved_memory_bytes=0.0)

PER_LAYER = 12 * H * H + 13 * H          # QKV, proj, 2 MLP matrices + biases + 2 LayerNorms
EMB = V * H + S * H                      # word + position embeddings
FINAL_LN = 2 * H


def act_layer(b: int) -> float:
    return S * b * H * (34 + 5 * A * S / H)


def act_input(b: int) -> float:
    return 2 * S * b * H


def test_parameter_count_matches_megatron_345m():
    gpt = ModelSpec(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                    vocab_size=50304)
    # Megatron's GPT-345M with the GPT-2 vocabulary padded to 50304.
    assert gpt.num_params == 354_871_296
    assert TOY.num_params == L * PER_LAYER + EMB + FINAL_LN
    assert TOY.layer_weight_bytes() == 2 * PER_LAYER


def test_flops_and_activations_follow_megatron_formulas():
    b = 3
    assert TOY.layer_forward_flops(b) == pytest.approx(24 * b * S * H * H * (1 + S / (6 * H)))
    assert TOY.layer_activation_bytes(b) == pytest.approx(act_layer(b))
    # Korthikanti's tensor-parallel form: s b h (10 + 24/t + 5 a s / (h t)).
    t = 4
    assert TOY.layer_activation_bytes(b, t) == pytest.approx(
        S * b * H * (10 + 24 / t + 5 * A * S / (H * t)))
    assert TOY.input_activation_bytes(b) == act_input(b)


@pytest.mark.parametrize("schedule,recompute", list(itertools.product(
    ["none", "gpipe", "flush", "2bw"], [False, True])))
def test_memory_of_a_middle_stage(schedule, recompute):
    """Stage 1 of 4 holds only layers: the paper's MEMORY(.) term by term."""
    d, b, m = 4, 2, 8
    cm = CostModel(TOY, PLAIN)
    stage = cm.stage_costs(Config(w=1, d=d, b=b, m=m, recompute=recompute,
                                  schedule=schedule))[1]
    w_stage = (L // d) * PER_LAYER                       # |W| / d in parameters
    versions = 2 if schedule == "2bw" else 1
    n = {"none": 1, "gpipe": m, "flush": d - 1, "2bw": d - 1}[schedule]
    a_stage = (L // d) * act_layer(b)                    # |A_total(b)| / d
    if recompute:
        acts = a_stage + n * act_input(b)
    else:
        acts = n * (a_stage + act_input(b))
    # the explicit softmax's [s, s] bool causal mask: one per stage, whatever is in flight
    expected = versions * 2 * w_stage + 14 * w_stage + acts + S * S
    assert stage.in_flight == n
    assert stage.memory_bytes == pytest.approx(expected)


def test_memory_2bw_and_gpipe_worst_stage_match_paper_formulas():
    """Stage 0 (d in flight for 2bw, m for GPipe), with recomputation:
    2bw:   2|W|/d + |A_total(b)|/d + d |A_input(b)|    (+ optimizer state)
    gpipe:  |W|/d + |A_total(b)|/d + m |A_input(b)|    (+ optimizer state)."""
    d, b, m = 4, 2, 8
    cm = CostModel(TOY, PLAIN)
    w0 = (L // d) * PER_LAYER + EMB                      # stage 0 also holds the embedding
    a0 = (L // d) * act_layer(b)
    mask = S * S                                         # the shared causal mask, once
    two = cm.stage_costs(Config(w=1, d=d, b=b, m=m, recompute=True, schedule="2bw"))[0]
    assert two.memory_bytes == pytest.approx(
        2 * 2 * w0 + a0 + d * act_input(b) + 14 * w0 + mask)
    gp = cm.stage_costs(Config(w=1, d=d, b=b, m=m, recompute=True, schedule="gpipe"))[0]
    assert gp.memory_bytes == pytest.approx(2 * w0 + a0 + m * act_input(b) + 14 * w0 + mask)
    # Without recomputation 2bw keeps d full stashes: 2|W|/d + d|A_total|/d + d|A_input|.
    two_nr = cm.stage_costs(Config(w=1, d=d, b=b, m=m, recompute=False, schedule="2bw"))[0]
    assert two_nr.memory_bytes == pytest.approx(
        4 * w0 + d * a0 + d * act_input(b) + 14 * w0 + mask)


@pytest.mark.parametrize("schedule", ["none", "gpipe", "flush", "2bw"])
def test_the_causal_mask_is_charged_once_per_stage(schedule):
    """--attention-backend local/unfused reads one [s, s] bool causal mask that a stage
    makes once and shares between its layers and microbatches: s^2 bytes per stage, the
    same with 1 or m microbatches in flight and under recomputation, on every tensor
    rank.  The fused kernels, BERT's padding mask and a document mask keep none."""
    cm = CostModel(TOY, PLAIN)
    for recompute in (False, True):
        for cfg in (Config(w=1, d=4, b=2, m=8, recompute=recompute, schedule=schedule),
                    Config(w=1, d=4, t=2, b=2, m=8, recompute=recompute, schedule=schedule)):
            for st in cm.stage_costs(cfg):
                assert st.shared_bytes == S * S
                assert st.memory_bytes == pytest.approx(
                    st.weights_bytes + st.optimizer_bytes + st.activation_bytes
                    + st.stash_bytes + S * S)
    cfg = Config(w=1, d=2, b=2, m=4, schedule=schedule)
    for other in (dataclasses.replace(TOY, attention_backend="auto"),
                  dataclasses.replace(TOY, reset_attention_mask=True),
                  dataclasses.replace(TOY, kind="bert")):
        assert other.causal_mask_bytes() == 0
        assert all(st.shared_bytes == 0 for st in CostModel(other, PLAIN).stage_costs(cfg))


def test_last_stage_holds_tied_embedding_and_logits():
    d, b = 2, 1
    last = CostModel(TOY, PLAIN).stage_costs(Config(w=1, d=d, b=b, m=4, schedule="flush"))[-1]
    assert last.params == (L // d) * PER_LAYER + FINAL_LN + V * H
    # final norm input and output (2 fp16 values each), the fp16 logits the loss keeps
    a_last = (L // d) * act_layer(b) + 4 * S * b * H + 2 * S * b * V
    assert last.activation_bytes == pytest.approx(a_last)
    # the paper's Megatron: the loss on a float32 copy of the logits
    paper = dataclasses.replace(TOY, fp32_logits=True)
    last = CostModel(paper, PLAIN).stage_costs(Config(w=1, d=d, b=b, m=4, schedule="flush"))[-1]
    assert last.activation_bytes == pytest.approx(a_last + 2 * S * b * V)


def _times(config: Config, c_extra: float = 4 / 3):
    """Hand THROUGHPUT(.) for TOY on PLAIN, d stages in one server, t = 1."""
    d, b = config.d, config.b
    f_layer = 24 * b * S * H * H * (1 + S / (6 * H)) / 1e12
    head = 2 * b * S * H * V / 1e12
    fwd = [(L // d) * f_layer + (head if i == d - 1 else 0) for i in range(d)]
    mult = c_extra if config.recompute else 1.0
    comp = [3 * f * mult for f in fwd]
    hop = 2 * act_input(b) / 1e11                         # activation + gradient per boundary
    slots = [c + hop * ((i > 0) + (i < d - 1)) for i, c in enumerate(comp)]
    return slots


@pytest.mark.parametrize("schedule", ["none", "gpipe", "flush", "2bw"])
@pytest.mark.parametrize("recompute", [False, True])
def test_batch_time_per_schedule(schedule, recompute):
    d, m, b = 4, 8, 2
    cfg = Config(w=1, d=d, b=b, m=m, recompute=recompute, schedule=schedule)
    est = CostModel(TOY, PLAIN).estimate(cfg)
    slots = _times(cfg)
    # After a flush the tied-embedding gradient sync (first <-> last stage, fp16) is
    # exposed; 2bw hides it behind the next batch (Appendix A's max(., T_comm / m)).
    emb_sync = 2 * (2 - 1) / 2 * (2 * V * H) / 1e11
    expected = {"none": m * sum(slots) + emb_sync,
                "gpipe": (m - 1) * max(slots) + sum(slots) + emb_sync,
                "flush": (m - 1) * max(slots) + sum(slots) + emb_sync,
                "2bw": m * max(slots)}[schedule]
    assert est.batch_time_s == pytest.approx(expected, rel=1e-12)
    assert est.samples_per_s == pytest.approx(b * m / expected)
    assert est.bubble_fraction == pytest.approx(1 - m * sum(slots) / (d * expected))


def test_uniform_stages_give_the_textbook_bubbles():
    gpt = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=1)       # negligible head: all stages equal
    hw = HardwareSpec(name="fast", gpus_per_server=64, gpu_memory_bytes=1e12, peak_flops=1e12,
                      achieved_flops=1e12, intra_server_bandwidth=1e30,
                      inter_server_bandwidth=1e30)
    cm = CostModel(gpt, hw)
    d, m = 4, 12
    flush = cm.estimate(Config(w=1, d=d, m=m, schedule="flush"))
    assert flush.bubble_fraction == pytest.approx((d - 1) / (m + d - 1), abs=2e-3)
    assert cm.estimate(Config(w=1, d=d, m=m, schedule="2bw")).bubble_fraction < 2e-3
    assert cm.estimate(Config(w=1, d=d, m=m, schedule="none")).bubble_fraction == pytest.approx(
        (d - 1) / d, rel=1e-3)


def test_c_extra_is_settable():
    cfg = Config(w=1, d=2, b=1, m=4, recompute=True, schedule="2bw")
    for c in (4 / 3, 1.5):
        est = CostModel(TOY, PLAIN, CostOptions(c_extra=c)).estimate(cfg)
        assert est.batch_time_s == pytest.approx(4 * max(_times(cfg, c)), rel=1e-12)


def test_data_parallel_allreduce_inside_and_across_servers():
    hw = HardwareSpec(name="two-level", gpus_per_server=4, gpu_memory_bytes=1e12,
                      peak_flops=1e12, achieved_flops=1e12, intra_server_bandwidth=1e11,
                      inter_server_bandwidth=1e9)
    cm = CostModel(TOY, hw)
    inside = cm.stage_costs(Config(w=4, d=2, m=4, schedule="flush"))
    grads = 2 * ((L // 2) * PER_LAYER + EMB)
    emb_sync = 2 * V * H / 1e9               # first <-> last stage cross servers: 4 pairs
    assert inside[0].allreduce_s == pytest.approx(2 * 3 / 4 * grads / 1e11 + emb_sync * 4)
    # w = 8 spans two servers: one ring, which has the NIC to itself.
    across = cm.stage_costs(Config(w=8, d=1, m=4, schedule="none"))
    grads1 = 2 * TOY.num_params
    assert across[0].allreduce_s == pytest.approx(2 * 7 / 8 * grads1 / 1e9)
    # t=2, w=4: two rings ({0,2,4,6} and {1,3,5,7}) share each server's NIC.
    shared = cm.stage_costs(Config(w=4, d=1, t=2, m=4, schedule="none"))
    assert shared[0].allreduce_s == pytest.approx(
        2 * 3 / 4 * (grads1 / 2) / (1e9 / 2))


def test_tensor_parallel_adds_four_allreduces_per_layer():
    cm = CostModel(TOY, PLAIN)
    one = cm.stage_costs(Config(w=1, d=1, t=1, b=1, m=1, schedule="none"))[0]
    two = cm.stage_costs(Config(w=1, d=1, t=2, b=1, m=1, schedule="none"))[0]
    ar = 2 * (2 - 1) / 2 * act_input(1) / 1e11
    # compute halves; forward gains 2 per layer + the embedding's, backward 2 per layer + 1
    assert two.forward_s == pytest.approx(one.forward_s / 2 + (2 * L + 1) * ar)
    assert two.backward_s == pytest.approx(one.backward_s / 2 + (2 * L + 1) * ar)


def _reference_links(t, w, d, g):
    """Brute-force: slowest-group load per traffic kind (members per server count)."""
    def rank(tp, dp, pp):
        return tp + t * (dp + w * pp)

    def load(groups):
        per = {}
        for grp in groups:
            servers = {r // g for r in grp}
            if len(servers) > 1:
                for s in servers:
                    per[s] = per.get(s, 0) + 1
        return max(per.values(), default=0)
    tensor = load([[rank(i, j, k) for i in range(t)] for j in range(w) for k in range(d)])
    data = load([[rank(i, j, k) for j in range(w)] for i in range(t) for k in range(d)])
    bounds = [load([[rank(i, j, k), rank(i, j, k + 1)] for i in range(t) for j in range(w)])
              for k in range(d - 1)]
    return tensor, data, bounds


@pytest.mark.parametrize("t,w,d,g", [(1, 8, 8, 8), (1, 4, 16, 8), (16, 4, 1, 8), (2, 2, 4, 4),
                                     (4, 2, 2, 8), (1, 3, 4, 6), (8, 1, 8, 8), (2, 8, 2, 8)])
def test_links_match_brute_force_placement(t, w, d, g):
    intra, inter = 100.0, 1.0
    links = placement_links(t, w, d, g, intra, inter)
    tensor, data, bounds = _reference_links(t, w, d, g)

    def bw(load):
        return intra if load == 0 else inter / load
    assert links.tensor == bw(tensor)
    assert links.data == bw(data)
    assert list(links.boundary) == [bw(x) for x in bounds]


def test_placement_examples_from_the_paper_setup():
    # 64 GPUs, 8 per server, w=8 d=8: replicas share a server, every boundary crosses
    # and all 8 GPUs of a server send through its NIC.
    links = placement_links(1, 8, 8, 8, 150.0, 3.125)
    assert links.data == 150.0 and not links.data_crosses_servers
    assert links.boundary == (3.125 / 8,) * 7
    # w=4 d=16: two stages per server, every other boundary crosses.
    links = placement_links(1, 4, 16, 8, 150.0, 3.125)
    assert links.boundary[0] == 150.0 and links.boundary[1] == 3.125 / 4
    text = describe_links(placement_links(1, 4, 16, 8, 150e9, 3.125e9), 1, 4, 16)
    assert "data-parallel all-reduce inside a server" in text
    assert "7 of 15 stage boundaries cross servers" in text
    assert ring_allreduce_time(8.0, 4, 2.0) == pytest.approx(2 * 3 / 4 * 8 / 2)


def test_bad_configs_have_clear_errors():
    cm = CostModel(TOY, PLAIN)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 3 must divide"):
        cm.estimate(Config(w=1, d=3))
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 8 must divide"):
        cm.estimate(Config(w=1, d=1, t=8))
    with pytest.raises(ValueError, match="--pipeline-schedule"):
        Config(w=1, d=1, schedule="1f1b")
    with pytest.raises(ValueError, match="--hidden-size 65 must be divisible"):
        ModelSpec(num_layers=2, hidden_size=65, num_attention_heads=4, seq_length=8,
                  vocab_size=10)


def test_flush_data_parallel_reduce_overlaps_the_last_backward():
    """The executor's bucket hooks start the data-parallel all-reduce during the last
    backward pass; only the last bucket (or what outlasts the backward) is exposed."""
    import math

    from megatron.pipeline.planner.cost_model import CostOptions

    cfg = Config(w=4, d=1, b=2, m=4, schedule="flush")
    bucket = 64 * 1024  # the toy model's gradients fill several buckets
    on = CostModel(TOY, PLAIN, CostOptions(grad_bucket_bytes=bucket)).estimate(cfg)
    off = CostModel(TOY, PLAIN, CostOptions(overlap_grad_reduce=False)).estimate(cfg)
    one = CostModel(TOY, PLAIN).estimate(cfg)  # 32 MiB default: one bucket, nothing hides
    assert one.batch_time_s == pytest.approx(off.batch_time_s)
    st = on.stages[0]
    assert st.dp_allreduce_s > 0
    # the executor's buckets, whole parameters each (tests/unit/test_planner_buckets.py):
    # more than the gradient bytes' share of 64 KiB ones
    buckets = st.dp_buckets
    assert buckets >= math.ceil(st.params * 2 / bucket) > 1
    assert st.dp_exposed_s == pytest.approx(max(st.dp_allreduce_s / buckets,
                                                st.dp_allreduce_s - st.backward_s))
    assert off.stages[0].dp_exposed_s == pytest.approx(st.dp_allreduce_s)
    assert off.batch_time_s - on.batch_time_s == pytest.approx(
        st.dp_allreduce_s - st.dp_exposed_s, rel=1e-9)
    assert on.batch_time_s < off.batch_time_s


def test_layer_level_recompute_memory_and_time():
    """uniform N keeps one hidden state per chunk of N layers and rebuilds a chunk at a
    time; block N checkpoints the first N layers; both re-run those layers' forward."""
    from dataclasses import replace

    cm = CostModel(TOY, PLAIN)
    base = Config(w=1, d=1, b=2, m=4, schedule="flush")
    plain = cm.estimate(base).stages[0]
    layers = TOY.num_layers
    layer_act = TOY.layer_activation_bytes(2)
    inp = TOY.input_activation_bytes(2)
    for method, n, k, chunks, rebuilt in (("uniform", 1, layers, layers, 1),
                                          ("uniform", 2, layers, -(-layers // 2), 2),
                                          ("block", 1, 1, 1, 1)):
        st = cm.estimate(replace(base, recompute_method=method, recompute_num_layers=n)).stages[0]
        per_mb = plain.activation_per_microbatch_bytes - k * layer_act + chunks * inp
        assert st.activation_per_microbatch_bytes == pytest.approx(per_mb)
        assert st.activation_bytes == pytest.approx(st.in_flight * per_mb + rebuilt * layer_act)
        assert st.backward_s > plain.backward_s
        assert st.forward_s == pytest.approx(plain.forward_s)
    uniform1 = cm.estimate(replace(base, recompute_method="uniform", recompute_num_layers=1))
    assert uniform1.memory_per_gpu_bytes < cm.estimate(base).memory_per_gpu_bytes
    with pytest.raises(ValueError, match="stage-level"):
        replace(base, recompute=True, recompute_method="uniform", recompute_num_layers=1)



def test_distributed_optimizer_splits_the_state_and_gathers_the_weights():
    """--use-distributed-optimizer: masters and moments (12 of the 14 bytes) split over
    the w replicas of a stage, the gradients (2) whole; the gradients are
    reduce-scattered (half a ring all-reduce) and after the step the weights are
    all-gathered: the other half, of one fp16 weight version.  The tied word embedding
    of first and last stage is still all-reduced in full (its other half)."""
    cfg = Config(w=4, d=2, b=2, m=4, schedule="flush")
    plain = CostModel(TOY, PLAIN).stage_costs(cfg)
    # the whole gather in the step (the overlap: the next test)
    waited = CostOptions(overlap_param_gather=False)
    sharded = CostModel(TOY, PLAIN, waited).stage_costs(
        dataclasses.replace(cfg, distributed_optimizer=True))
    for p, s in zip(plain, sharded):
        assert p.optimizer_bytes == pytest.approx(14 * p.params)
        assert s.optimizer_bytes == pytest.approx((2 + 12 / 4) * s.params)
        assert s.weights_bytes == p.weights_bytes and s.activation_bytes == p.activation_bytes
        links = CostModel(TOY, PLAIN).estimate(cfg).links
        assert s.step_s - p.step_s == pytest.approx(
            0.5 * ring_allreduce_time(2 * p.params, 4, links.data))
        embedding = 0.5 * ring_allreduce_time(2 * TOY.vocab_size * TOY.hidden_size, 4,
                                              links.data)
        assert TOY.tied_output and embedding > 0      # d = 2: both stages hold it
        assert s.dp_allreduce_s == pytest.approx(0.5 * p.dp_allreduce_s + embedding)
        assert p.dp_allreduce_s == pytest.approx(
            ring_allreduce_time(2 * p.params, 4, links.data))
    # one replica: nothing to split
    one = Config(w=1, d=2, b=2, m=4, schedule="flush")
    assert CostModel(TOY, PLAIN).stage_costs(dataclasses.replace(
        one, distributed_optimizer=True)) == CostModel(TOY, PLAIN).stage_costs(one)


@pytest.mark.parametrize("tied,bucket_bytes", [(False, 1e12), (True, 1e12), (True, 4096.0)])
def test_overlapped_weight_gather_hides_behind_one_forward(tied, bucket_bytes):
    """--overlap-param-gather (the planner's command passes it): the weights' all-gather
    runs into the next forward pass, each layer waiting for its own buckets, so what
    shows is the larger of one bucket's share and what a microbatch's forward cannot
    cover; waited for at the step it shows whole.  On a slow data-parallel link (1e6
    bytes/s) the gather outlasts the forward.  With one bucket nothing hides: an untied
    model's stage in buckets larger than it; a tied word embedding is a bucket of its
    own (the executor's buckets: tests/unit/test_planner_buckets.py)."""
    model = TOY if tied else dataclasses.replace(TOY, untie_embeddings_and_output_weights=True)
    slow = dataclasses.replace(PLAIN, intra_server_bandwidth=1e6)
    cfg = Config(w=4, d=2, b=2, m=4, schedule="flush", distributed_optimizer=True)
    on = CostModel(model, slow, CostOptions(grad_bucket_bytes=bucket_bytes)).stage_costs(cfg)
    off = CostModel(model, slow, CostOptions(grad_bucket_bytes=bucket_bytes,
                                             overlap_param_gather=False)).stage_costs(cfg)
    links = CostModel(model, slow).estimate(cfg).links
    for a, b in zip(on, off):
        gather = 0.5 * ring_allreduce_time(2 * a.params, 4, links.data)
        assert gather > a.forward_s
        buckets = a.gather_buckets
        if bucket_bytes > 1e6:  # larger than a stage: one, and the tied embedding's own
            assert buckets == (2 if tied else 1)
        else:
            assert buckets > 2
        assert b.step_s - a.step_s == pytest.approx(
            gather - max(gather / buckets, gather - a.forward_s))
        # one bucket: the first layer waits for all of it, nothing hides
        assert (b.step_s > a.step_s) == (buckets > 1)


def test_2bw_exposes_what_the_executor_cannot_hide():
    """The first stage begins its update before batch t+2 (m - d + 1 slots after its last
    backward), stage i > 0 at its aligned STEP one slot earlier (the earlier stages'
    backward passes after its own, and m - d more slots); Appendix A hides everything."""
    slow = dataclasses.replace(PLAIN, intra_server_bandwidth=1e9)  # all-reduce ~ 4 slots
    d = 2
    exposed_by_m = []
    for m in (2, 4, 8):
        cfg = Config(w=2, d=d, b=2, m=m, schedule="2bw")
        est = CostModel(TOY, slow).estimate(cfg)
        st = est.stages
        own = [s.dp_exposed_s + (s.allreduce_s - s.dp_allreduce_s) for s in st]
        first = max(0.0, own[0] - (m - d + 1) * st[0].slot_s)
        last = max(0.0, own[1] - st[0].backward_s - (m - d) * st[0].slot_s)
        exposed = max(first, last)
        slowest = max(s.slot_s for s in st)
        assert est.batch_time_s == pytest.approx(
            max(m * slowest + exposed, max(s.allreduce_s for s in st)), rel=1e-12)
        paper = CostModel(TOY, slow, CostOptions(appendix_a_2bw=True)).estimate(cfg)
        assert paper.batch_time_s == pytest.approx(
            max(max(m * s.slot_s, s.allreduce_s) for s in st), rel=1e-12)
        assert paper.batch_time_s <= est.batch_time_s
        exposed_by_m.append((first, last))
    # longer batches give every stage more time: less is exposed, at m = 8 nothing
    for k in range(2):
        assert exposed_by_m[0][k] > exposed_by_m[1][k] > exposed_by_m[2][k] == 0.0

"""tools/profile_model.py: byte counts against sizes computed by hand, and the JSON it writes.

Tiny shapes (h=32, s=16, 4 heads, vocab 64), dropout 0, one timed run: the byte counts
do not depend on speed, so only they and the file's structure are asserted.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from megatron.config import ModelConfig
from megatron.pipeline.planner.profile import Profile
from megatron.pipeline.planner.measure import saved_activation_bytes, weight_storage_ptrs
from tools.profile_model import main, profile_model

S, H, HEADS, V = 16, 32, 4, 64


def _config(dtype: torch.dtype, ffn=None) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                       ffn_hidden_size=ffn, padded_vocab_size=V, hidden_dropout=0.0,
                       attention_dropout=0.0, params_dtype=dtype)


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def profiled(request):
    torch.set_num_threads(1)
    dtype = request.param
    return dtype, profile_model(_config(dtype), [1, 2, 3], warmup=0, repeat=1,
                                device=torch.device("cpu"))


def test_linear_chain_saved_bytes_by_hand():
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4), nn.Sigmoid())
    x = torch.randn(5, 8, requires_grad=True)
    out, nbytes = saved_activation_bytes(lambda: chain(x), weight_storage_ptrs(chain))
    # Linear 1 keeps x; Tanh keeps its output, which Linear 2 keeps too (one storage,
    # counted once); Sigmoid keeps its output.  Weights are left out.
    assert nbytes == (5 * 8 + 5 * 16 + 5 * 4) * 4
    assert out.shape == (5, 4)
    # a chain that saves nothing that is not a weight: scaling by a constant
    _, none = saved_activation_bytes(lambda: x * 2.0, set())
    assert none == 0


def test_block_weight_bytes_are_12h2_plus_13h_params(profiled):
    dtype, prof = profiled
    e = torch.empty((), dtype=dtype).element_size()
    w = prof["weights"]
    assert w["block_params"] == 12 * H * H + 13 * H
    assert w["block_bytes"] == (12 * H * H + 13 * H) * e
    assert w["embedding_params"] == V * H + S * H  # word + position tables
    assert w["head_bytes"] == 2 * H * e  # final LayerNorm; the word embedding is tied
    assert w["tied_embedding_bytes"] == V * H * e


def test_stage_input_and_data_bytes_exact(profiled):
    dtype, prof = profiled
    e = torch.empty((), dtype=dtype).element_size()
    for row in prof["microbatches"]:
        b = row["micro_batch_size"]
        assert row["stage_input_bytes"] == S * b * H * e
        assert row["data_bytes"] == b * (S + 1) * 8


def test_block_stash_bytes_by_hand(profiled):
    """Saved by one block (dropout 0, torch's fused causal attention), per microbatch:
    x, LN1 out, attention context, x after attention, LN2 out: 5 [s,b,h]; the fused QKV
    output (q, k, v are views of it): 3 [s,b,h]; GeLU input and output: 2 [s,b,f];
    LayerNorm mean and rstd: 4 [s,b]; the attention kernel's log-sum-exp: [b,a,s] in
    fp32 or wider -- no [b,a,s,s] probabilities and no mask."""
    dtype, prof = profiled
    e = torch.empty((), dtype=dtype).element_size()
    lse = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    f = 4 * H
    for row in prof["microbatches"]:
        b = row["micro_batch_size"]
        hand = (8 * S * b * H + 2 * S * b * f + 4 * S * b) * e + HEADS * b * S * lse
        assert row["block"]["stash_bytes"] == hand, (b, row["block"]["stash_bytes"], hand)


def test_manual_attention_stash_bytes_by_hand():
    """The reference attention path saves the [b,a,s,s] softmax probabilities and the
    s*s causal mask (one per call); the fused kernel keeps a [b,a,s] log-sum-exp and its
    output (which, in a block, is the storage the dense layer after it saves anyway: see
    the block count above).  The counter sees exactly that difference."""
    from megatron.model.transformer import CoreAttention
    from megatron.pipeline.memory import StashTracker
    from megatron.tensor_parallel import TPInfo

    b, hd = 2, H // HEADS
    counts = {}
    for backend in ("manual", "sdpa"):
        core = CoreAttention(_config(torch.float32), TPInfo.single(), backend).train()
        q, k, v = (torch.randn(S, b, HEADS, hd, requires_grad=True) for _ in range(3))
        tracker = StashTracker(set())
        with tracker.counting(0, 0):
            out = core(q, k, v, None)
        counts[backend] = tracker.in_flight[0]
        out.sum().backward()
    probs, mask, lse, out = HEADS * b * S * S * 4, S * S, HEADS * b * S * 4, S * b * H * 4
    assert counts["manual"] - counts["sdpa"] == probs + mask - lse - out, counts


def test_embedding_and_head_stash_bytes_by_hand(profiled):
    dtype, prof = profiled
    e = torch.empty((), dtype=dtype).element_size()
    for row in prof["microbatches"]:
        b = row["micro_batch_size"]
        # token ids [b, s] int64 (at b = 1 the slice shares the [1, s+1] sample) and the
        # position ids, an expanded view of one arange(s)
        tokens = (S + 1) * 8 if b == 1 else b * S * 8
        assert row["embedding"]["stash_bytes"] == tokens + S * 8
        # final LN input + its output (kept by the logits matmul), LN mean/rstd, the
        # logits and per-token log-sum-exp of the chunked cross-entropy, local targets
        # (int64), out-of-range mask (bool), the fp32 loss mask and the fp32 denominator
        # of the masked mean
        head = (2 * S * b * H + 2 * S * b + S * b * V + S * b) * e + S * b * (8 + 1 + 4) + 4
        assert row["head"]["stash_bytes"] == head


def test_stash_bytes_affine_in_b_from_2(profiled):
    dtype, prof = profiled
    rows = {r["micro_batch_size"]: r for r in prof["microbatches"]}
    for name in ("block", "head"):
        s1, s2, s3 = (rows[b][name]["stash_bytes"] for b in (1, 2, 3))
        assert s3 - s2 == s2 - s1 > 0
    # extrapolating from measured b = 2, 3 gives the count measured at b = 4 exactly
    direct = profile_model(_config(dtype), [2, 3, 4], warmup=0, repeat=1)
    two_three = Profile({**direct, "microbatches": direct["microbatches"][:2]})
    want = direct["microbatches"][2]
    for name in ("block", "embedding", "head"):
        assert two_three.piece(name, 4).stash_bytes == want[name]["stash_bytes"]


def test_times_are_positive_and_json_round_trips(tmp_path):
    out = tmp_path / "p.json"
    rc = main(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--vocab-size", "50", "--make-vocab-size-divisible-by",
               "32", "--micro-batch-sizes", "2", "1", "--warmup", "1", "--repeat", "2",
               "--threads", "1", "--device", "cpu", "--output", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "megatron-pipedream-profile/1"
    assert data["device"]["type"] == "cpu" and data["device"]["torch"] == torch.__version__
    assert data["device"]["threads"] == 1
    assert data["model"]["vocab_size"] == 64  # padded like the trainer does
    assert [r["micro_batch_size"] for r in data["microbatches"]] == [1, 2]
    for row in data["microbatches"]:
        for name in ("block", "embedding", "head"):
            piece = row[name]
            assert piece["forward_s"] > 0 and piece["backward_s"] > 0
            assert piece["forward_cpu_s"] >= 0 and len(piece["forward_samples_s"]) == 2
    assert all(v > 0 for v in data["optimizer_step_calls_s"].values())
    assert all(v >= 0 for v in data["optimizer_step_s"].values())
    assert set(data["optimizer_step_s"]) == {"fixed", "block", "embedding", "head",
                                             "tied_embedding"}
    prof = Profile.load(out)
    assert prof.micro_batch_sizes == (1, 2)
    assert prof.model_spec().hidden_size == 32


def test_whole_stages_are_timed_and_their_stash_is_the_sum_of_the_pieces(profiled):
    """Each stage kind is a GPTModel stage run through pretrain_gpt.forward_step: the
    bytes it saves are exactly its pieces' (so the pieces compose into stages), and
    Profile reads the difference in time as the trainer's own work per microbatch."""
    dtype, prof = profiled
    chain = prof["settings"]["chain_blocks"]
    for row in prof["microbatches"]:
        assert set(row["stages"]) == {"whole", "first", "middle", "last"}
        for kind, st in row["stages"].items():
            pre, post = kind in ("whole", "first"), kind in ("whole", "last")
            assert st["layers"] == chain
            assert st["stash_bytes"] == (chain * row["block"]["stash_bytes"]
                                         + pre * row["embedding"]["stash_bytes"]
                                         + post * row["head"]["stash_bytes"])
            assert st["forward_s"] > 0 and st["backward_s"] > 0
    loaded = Profile(prof)
    assert loaded.has_overhead
    row = prof["microbatches"][1]
    pieces = (chain * row["block"]["forward_s"] + row["embedding"]["forward_s"]
              + row["head"]["forward_s"])
    assert loaded.overhead(True, True, row["micro_batch_size"])[0] == pytest.approx(
        max(row["stages"]["whole"]["forward_s"] - pieces, 0.0))  # noise can make it < 0


def test_no_stages_skips_the_stage_timing():
    prof = profile_model(_config(torch.float32), [2], warmup=0, repeat=1, stages=False)
    assert "stages" not in prof["microbatches"][0]
    assert not Profile(prof).has_overhead


def test_bad_flags_give_one_clear_error(tmp_path, capsys):
    rc = main(["--num-layers", "2", "--hidden-size", "30", "--num-attention-heads", "4",
               "--seq-length", "16", "--vocab-size", "64", "--output", str(tmp_path / "x")])
    assert rc == 2
    assert "--hidden-size 30 must be divisible by --num-attention-heads 4" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="micro-batch-sizes"):
        profile_model(_config(torch.float32), [0])


def test_runs_per_sync_queues_runs_and_keeps_the_stash_count():
    """Several forwards queued per synchronisation (the CUDA default, 8): per-run times,
    the same stash bytes, and the count recorded; 0 is an error."""
    cpu = torch.device("cpu")  # the default is 8 on a CUDA device, 1 on the CPU
    one = profile_model(_config(torch.float32), [2], warmup=0, repeat=1, device=cpu)
    three = profile_model(_config(torch.float32), [2], warmup=0, repeat=1, runs_per_sync=3,
                          device=cpu)
    assert one["settings"]["runs_per_sync"] == 1 and three["settings"]["runs_per_sync"] == 3
    for name in ("block", "embedding", "head"):
        a, b = one["microbatches"][0][name], three["microbatches"][0][name]
        assert b["runs_per_sync"] == 3 and b["stash_bytes"] == a["stash_bytes"]
        assert b["forward_s"] > 0 and b["backward_s"] > 0
    with pytest.raises(ValueError, match="runs-per-sync"):
        profile_model(_config(torch.float32), [2], runs_per_sync=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_peaks_cover_counted_stash():
    prof = profile_model(_config(torch.float32), [2], warmup=1, repeat=2,
                         device=torch.device("cuda"))
    row = prof["microbatches"][0]
    assert prof["device"]["type"] == "cuda"
    # inputs allocated before the forward (stage input, token ids, masks) are saved but
    # not part of the allocator's delta
    before = row["stage_input_bytes"] + 3 * row["data_bytes"]
    for name in ("block", "embedding", "head"):
        piece = row[name]
        assert piece["cuda_retained_bytes"] >= piece["stash_bytes"] - before
        assert piece["cuda_forward_peak_bytes"] >= piece["cuda_retained_bytes"] > 0


def test_block_is_timed_as_a_chain_of_distinct_layers():
    """The per-block cost comes from min(num_layers, 4) distinct layers run back to back
    (a stage's layers do not see an input they have just seen); stash bytes and weight
    bytes stay per block, the chain length is recorded, and 0 is an error."""
    cfg = _config(torch.float32)  # 2 layers -> a chain of 2
    default = profile_model(cfg, [2], warmup=0, repeat=1)
    one = profile_model(cfg, [2], warmup=0, repeat=1, chain_blocks=1)
    three = profile_model(cfg, [2], warmup=0, repeat=1, chain_blocks=3)
    assert default["settings"]["chain_blocks"] == 2
    assert one["settings"]["chain_blocks"] == 1 and three["settings"]["chain_blocks"] == 3
    a, b, c = (p["microbatches"][0]["block"] for p in (one, default, three))
    assert a["stash_bytes"] == b["stash_bytes"] == c["stash_bytes"]
    assert "chained" not in a and b["chained"] == 2 and c["chained"] == 3
    assert one["weights"] == three["weights"]
    with pytest.raises(ValueError, match="--chain-blocks 0"):
        profile_model(cfg, [2], chain_blocks=0)


def test_default_chain_fits_a_small_gpu():
    """Four layers by default, fewer where a quarter of the free memory cannot hold four
    layers' weights (a model whose one layer barely fits still profiles), never zero."""
    from tools.profile_model import default_chain_blocks

    cfg = _config(torch.float32)  # 2 layers of h=32: 12h^2 + 13h params, fp32
    layer = (12 * H * H + 13 * H) * 4
    cpu = torch.device("cpu")
    assert default_chain_blocks(cfg, cpu) == 2
    assert default_chain_blocks(cfg, cpu, free_bytes=4 * 2 * layer) == 2
    assert default_chain_blocks(cfg, cpu, free_bytes=4 * layer) == 1
    assert default_chain_blocks(cfg, cpu, free_bytes=10) == 1


def test_optimizer_step_model_splits_a_fixed_cost_from_per_block_costs():
    """A step costs a fixed part once per stage plus a part per parameter: the chain of
    blocks separates them, and a 24-block stage is predicted from one and four blocks."""
    from megatron.pipeline.planner.measure import optimizer_step_model
    fixed, per_block = 0.9e-3, 0.05e-3
    calls = {"block": fixed + per_block, "blocks": fixed + 4 * per_block,
             "embedding": fixed + 0.2e-3, "head": fixed / 2, "tied_embedding": fixed + 0.2e-3}
    got = optimizer_step_model(calls, chain=4)
    assert got["fixed"] == pytest.approx(fixed) and got["block"] == pytest.approx(per_block)
    assert got["embedding"] == pytest.approx(0.2e-3) and got["head"] == 0.0  # clamped
    stage = got["fixed"] + 24 * got["block"] + got["embedding"]
    assert stage == pytest.approx(fixed + 24 * per_block + 0.2e-3)
    # one block: nothing separates the parts, each piece is its whole call (as before)
    one = optimizer_step_model({k: v for k, v in calls.items() if k != "blocks"}, chain=1)
    assert one["fixed"] == 0.0 and one["block"] == calls["block"]
    assert one["embedding"] == calls["embedding"]


def test_fused_loss_flag_reaches_the_head_and_the_profile():
    """--cross-entropy-loss-fusion: the head is timed with the fused loss, and the profile
    says so (tools/plan.py then passes the flag on)."""
    from tools.profile_model import build_parser, config_from_args
    from tools.profile_pieces import HeadPiece
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
            "--seq-length", "8", "--vocab-size", "64"]
    plain = config_from_args(build_parser().parse_args(base))
    fused = config_from_args(build_parser().parse_args(base + ["--cross-entropy-loss-fusion"]))
    assert not plain.cross_entropy_loss_fusion and fused.cross_entropy_loss_fusion
    assert HeadPiece(fused).fused and not HeadPiece(plain).fused
    prof = profile_model(fused, [1], warmup=0, repeat=1, device=torch.device("cpu"),
                         stages=False)
    assert prof["model"]["cross_entropy_loss_fusion"] is True


def test_bf16_profile_times_float32_gradients_as_the_trainer_accumulates_them(monkeypatch):
    """Under bf16 the trainer sums gradients in float32: the profile's pieces are widened
    (their backward pays that cast), its optimizer step gets float32 gradients, and it
    records 4-byte gradients; other dtypes keep the weights' own width."""
    from megatron.config import GRAD_DTYPE_SUPPORTED
    from megatron.optimizer.optimizer import MegatronOptimizer
    if not GRAD_DTYPE_SUPPORTED:
        pytest.skip("Tensor.grad_dtype needs torch >= 2.10")
    widened, stepped = [], []
    import megatron.pipeline.weights as weights
    real_set = weights.set_grad_dtype
    monkeypatch.setattr(weights, "set_grad_dtype",
                        lambda params, dtype: (widened.append(dtype), real_set(params, dtype)))
    real_begin = MegatronOptimizer.begin_step

    def begin(self, grads_from, **kw):
        stepped.extend(p.grad.dtype for p in grads_from if p.grad is not None)
        return real_begin(self, grads_from, **kw)

    monkeypatch.setattr(MegatronOptimizer, "begin_step", begin)
    prof = profile_model(_config(torch.bfloat16), [1], warmup=0, repeat=1,
                         device=torch.device("cpu"), stages=False)
    assert prof["model"]["dtype_bytes"] == 2 and prof["model"]["grad_bytes"] == 4
    assert Profile(prof).grad_bytes() == 4.0
    assert widened == [torch.float32] * 3  # blocks, embedding, head
    assert stepped and set(stepped) == {torch.float32}
    widened.clear()
    fp64 = profile_model(_config(torch.float64), [1], warmup=0, repeat=1,
                         device=torch.device("cpu"), stages=False)
    assert fp64["model"]["grad_bytes"] == 8 and not widened

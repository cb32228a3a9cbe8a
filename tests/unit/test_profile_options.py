"""tools/profile_model.py --fp32-residual-connection / --reset-attention-mask, and what
megatron/pipeline/planner/profile.py and tools/plan.py make of such profiles.

Tiny shapes (2 layers, h=32, s=16, 4 heads, vocab 128), dropout 0, one timed run: the
byte counts do not depend on speed, so only they, the recorded flags and the planner's
answers are asserted.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from megatron.config import ModelConfig
from megatron.pipeline.planner import Config, CostModel
from megatron.pipeline.planner.profile import Profile
from tests.unit.test_planner_profile import FAST, make_profile
from tools.profile_model import main, profile_model

S, H, HEADS, V = 16, 32, 4, 128
SIZES = (1, 2)
BASE = ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
        "--seq-length", str(S), "--vocab-size", str(V), "--hidden-dropout", "0",
        "--attention-dropout", "0", "--micro-batch-sizes", "1", "2", "--warmup", "0",
        "--repeat", "1", "--threads", "1", "--device", "cpu"]


def _config(dtype: torch.dtype = torch.bfloat16, **kw) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                       padded_vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0,
                       params_dtype=dtype, **kw)


def _profile(dtype=torch.bfloat16, reset=False, **kw) -> dict:
    return profile_model(_config(dtype, **kw), SIZES, warmup=0, repeat=1,
                         device=torch.device("cpu"), reset_attention_mask=reset)


@pytest.fixture(scope="module")
def profiles():
    torch.set_num_threads(1)
    return {"causal": _profile(), "fp32_residual": _profile(fp32_residual_connection=True),
            "causal_unfused": _profile(attention_backend="unfused"),
            "masked": _profile(reset=True),
            "masked_unfused": _profile(torch.float32, reset=True, attention_backend="unfused"),
            "masked_fp32": _profile(torch.float32, reset=True)}


def _rows(prof: dict) -> dict:
    return {r["micro_batch_size"]: r for r in prof["microbatches"]}


def _norm_extras(flag: bool, b: int) -> int:
    """What one LayerNorm keeps beyond its input, which the formulas leave out: a mean and
    a 1/std per token (in the dtype torch keeps them for this input, measured) and, with
    a float32 stream, its float32 copies of its weight and bias."""
    dtype = torch.float32 if flag else torch.bfloat16
    w = torch.ones(H, dtype=dtype)
    _, mean, rstd = torch.native_layer_norm(torch.randn(S, b, H, dtype=dtype), (H,), w, w, 1e-5)
    return (mean.numel() * mean.element_size() + rstd.numel() * rstd.element_size()
            + (2 * H * 4 if flag else 0))


def test_the_profile_records_both_flags(tmp_path):
    out = tmp_path / "p.json"
    assert main(BASE + ["--bf16", "--fp32-residual-connection", "--reset-attention-mask",
                        "--no-stages", "--output", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["fp32_residual_connection"] is True and model["reset_attention_mask"] is True
    assert main(BASE + ["--bf16", "--no-stages", "--output", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["fp32_residual_connection"] is False and model["reset_attention_mask"] is False
    spec = Profile.load(out).model_spec()
    assert not spec.fp32_residual_connection and not spec.reset_attention_mask


def test_a_float32_stream_grows_the_block_head_and_input_by_the_formula(profiles):
    """bf16 with --fp32-residual-connection: the block keeps ``layer_activation_bytes``'s
    4 s b h more (its two norms read float32: 14 s b h in place of 10), the head the
    final norm's 2 s b h more (``head_activation_bytes``), plus the norms' float32
    statistics and weight copies; the stage input is float32; stages are their pieces."""
    spec = Profile(profiles["causal"]).model_spec()
    flag = Profile(profiles["fp32_residual"]).model_spec()
    assert flag.fp32_residual_connection and not spec.fp32_residual_connection
    plain, wide = _rows(profiles["causal"]), _rows(profiles["fp32_residual"])
    for b in SIZES:
        norms = _norm_extras(True, b) - _norm_extras(False, b)
        assert wide[b]["block"]["stash_bytes"] - plain[b]["block"]["stash_bytes"] == \
            flag.layer_activation_bytes(b) - spec.layer_activation_bytes(b) + 2 * norms
        assert wide[b]["head"]["stash_bytes"] - plain[b]["head"]["stash_bytes"] == \
            flag.head_activation_bytes(b) - spec.head_activation_bytes(b) + norms
        assert wide[b]["embedding"]["stash_bytes"] == plain[b]["embedding"]["stash_bytes"]
        assert wide[b]["stage_input_bytes"] == flag.input_activation_bytes(b) == 4 * S * b * H
        chain = profiles["fp32_residual"]["settings"]["chain_blocks"]
        for kind, st in wide[b]["stages"].items():
            pre, post = kind in ("whole", "first"), kind in ("whole", "last")
            assert st["stash_bytes"] == (chain * wide[b]["block"]["stash_bytes"]
                                         + pre * wide[b]["embedding"]["stash_bytes"]
                                         + post * wide[b]["head"]["stash_bytes"]), kind


def test_the_masked_block_count_leaves_the_document_mask_out(profiles):
    """The document mask (made once per stage and microbatch, here bf16 additive for
    torch's fused kernel) is not in the block's count, which is the causal one; the
    profile records it, and each timed stage keeps it once beyond its pieces."""
    from pretrain_gpt import GPTTask

    spec = Profile(profiles["masked"]).model_spec()
    assert spec.reset_attention_mask
    causal, masked = _rows(profiles["causal"]), _rows(profiles["masked"])
    chain = profiles["masked"]["settings"]["chain_blocks"]
    for b in SIZES:
        mask = masked[b]["attention_mask_bytes"]
        assert mask == spec.stage_mask_bytes(b) == 2 * b * S * S
        assert "attention_mask_bytes" not in causal[b]
        for name in ("block", "embedding", "head"):
            assert masked[b][name]["stash_bytes"] == causal[b][name]["stash_bytes"], name
        for kind, st in masked[b]["stages"].items():
            pre, post = kind in ("whole", "first"), kind in ("whole", "last")
            assert st["stash_bytes"] == (chain * masked[b]["block"]["stash_bytes"]
                                         + pre * masked[b]["embedding"]["stash_bytes"]
                                         + post * masked[b]["head"]["stash_bytes"] + mask), kind
    # the trainer's task settings are the caller's again
    assert not GPTTask.reset_attention_mask and GPTTask.eod is None


def test_the_pieces_run_on_the_float32_stream_with_each_microbatchs_mask(monkeypatch):
    """bf16 with both flags: the chained layers take and return the float32 stream, and
    get the bf16 additive [b, 1, s, s] mask ``prepare_mask`` makes of ``get_batch``'s
    document mask (which masks earlier tokens of other documents too); the embedding
    hands on, and the head and the timed stages after the first read, the float32
    stream."""
    from megatron.model import GPTModel
    from megatron.model.transformer import ParallelTransformerLayer
    from tools.profile_pieces import EmbeddingPiece, HeadPiece

    seen = {"mask": [], "layer": [], "embedding": [], "head": [], "stage": []}
    layer_fwd, emb_fwd, head_fwd = (ParallelTransformerLayer.forward, EmbeddingPiece.forward,
                                    HeadPiece.forward)

    def layer(self, x, mask=None, rotary=None):
        out = layer_fwd(self, x, mask, rotary)
        seen["mask"].append(mask)
        seen["layer"] += [x.dtype, out.dtype]
        return out

    def embedding(self, batch):
        out = emb_fwd(self, batch)
        seen["embedding"].append(out.dtype)
        return out

    def head(self, hidden, batch):
        seen["head"].append(hidden.dtype)
        return head_fwd(self, hidden, batch)

    monkeypatch.setattr(ParallelTransformerLayer, "forward", layer)
    monkeypatch.setattr(EmbeddingPiece, "forward", embedding)
    monkeypatch.setattr(HeadPiece, "forward", head)
    set_input = GPTModel.set_input_tensor

    def stage_input(self, x):
        seen["stage"].append(x.dtype)
        set_input(self, x)

    monkeypatch.setattr(GPTModel, "set_input_tensor", stage_input)
    profile_model(_config(fp32_residual_connection=True), SIZES, warmup=0, repeat=1,
                  device=torch.device("cpu"), reset_attention_mask=True)
    for key in ("layer", "embedding", "head", "stage"):
        assert seen[key] and set(seen[key]) == {torch.float32}, key
    assert {tuple(m.shape) for m in seen["mask"]} == {(b, 1, S, S) for b in SIZES}
    below = torch.ones(S, S, dtype=torch.bool).tril(-1)
    for m in seen["mask"]:
        assert m.dtype == torch.bfloat16
        assert (m[:, 0][:, below] != 0).any()      # not only the causal part is masked


@pytest.mark.parametrize("name", ["masked", "masked_unfused", "masked_fp32"])
def test_the_planner_stash_of_a_masked_stage_is_the_executors(profiles, name):
    """Per microbatch, what the cost model keeps of a stage planned from a masked profile
    (its activations plus its input) is what the executor's counter saw on the timed
    stage of that kind: the pieces once each and the mask once, as the profile measured
    it (a bf16 or float32 additive mask, or the explicit softmax's bool)."""
    data = profiles[name]
    prof = Profile(data)
    chain = data["settings"]["chain_blocks"]
    kinds = {1: ["whole"], 3: ["first", "middle", "last"]}
    for b, row in _rows(data).items():
        for d, names in kinds.items():
            cm = CostModel(prof.model_spec(num_layers=d * chain), FAST, profile=prof)
            stages = cm.stage_costs(Config(w=1, d=d, b=b, m=4, schedule="flush"))
            for stage, kind in zip(stages, names):
                measured = row["stages"][kind]["stash_bytes"]
                assert stage.activation_per_microbatch_bytes + stage.input_bytes == \
                    measured, (b, kind)
                first, last = kind in ("whole", "first"), kind in ("whole", "last")
                assert prof.stage_stash_bytes(chain, first, last, b) == measured


def test_the_planner_charges_the_causal_mask_of_the_explicit_softmax(profiles):
    """A causal profile with --attention-backend unfused: the stage's [s, s] bool causal
    mask is in no piece (the profile leaves it out of the block, as RoPE's table), and
    the timed stage of each kind, counted by the executor's counter for one microbatch,
    holds it once beyond its pieces.  The cost model charges it once per stage
    (``StageCost.shared_bytes``), so per microbatch the planner's count is the
    executor's to the byte."""
    data = profiles["causal_unfused"]
    prof = Profile(data)
    assert prof.model_spec().keeps_scores and not prof.model_spec().reset_attention_mask
    chain = data["settings"]["chain_blocks"]
    kinds = {1: ["whole"], 3: ["first", "middle", "last"]}
    for b, row in _rows(data).items():
        assert "attention_mask_bytes" not in row
        for d, names in kinds.items():
            cm = CostModel(prof.model_spec(num_layers=d * chain), FAST, profile=prof)
            stages = cm.stage_costs(Config(w=1, d=d, b=b, m=4, schedule="flush"))
            for stage, kind in zip(stages, names):
                st = row["stages"][kind]
                pre, post = kind in ("whole", "first"), kind in ("whole", "last")
                pieces = (chain * row["block"]["stash_bytes"]
                          + pre * row["embedding"]["stash_bytes"]
                          + post * row["head"]["stash_bytes"])
                assert st["stash_bytes"] == pieces + S * S, kind
                assert stage.shared_bytes == S * S
                assert stage.activation_per_microbatch_bytes + stage.input_bytes + \
                    stage.shared_bytes == st["stash_bytes"], (b, kind)
                assert prof.stage_stash_bytes(chain, pre, post, b) == st["stash_bytes"]
    # the fused kernels keep no mask: nothing to charge
    fused = Profile(profiles["causal"])
    cm = CostModel(fused.model_spec(), FAST, profile=fused)
    assert all(st.shared_bytes == 0 for st in cm.stage_costs(Config(w=1, d=1, b=2, m=4)))


@pytest.mark.parametrize("kind", ["whole", "middle"])
def test_the_causal_mask_is_one_tensor_for_every_microbatch_in_flight(profiles, kind):
    """n microbatches in flight on a GPTModel stage with --attention-backend unfused, run
    as the executor runs them (``pretrain_gpt.forward_step``, outputs kept until their
    backward): the distinct storages they keep are n times a microbatch's own bytes plus
    ONE causal mask (the stage's cached tensor, which every microbatch's layers save),
    which is what the planner charges a stage with n in flight: n (|A_i| + |A_input|) +
    the mask once.  The executor's counter finds the mask kept by two in-flight
    microbatches and charges it once too, so all three agree to the byte."""
    from megatron.model import GPTModel
    from megatron.pipeline.memory import StashTracker
    from megatron.tensor_parallel import TPInfo
    from pretrain_gpt import forward_step
    from megatron.pipeline.planner.measure import weight_storage_ptrs
    from tools.profile_pieces import sample_text

    data = profiles["causal_unfused"]
    prof = Profile(data)
    chain, b, n = data["settings"]["chain_blocks"], 2, 3
    d, stage = (1, 0) if kind == "whole" else (3, 1)
    config = dataclasses.replace(_config(attention_backend="unfused"), num_layers=d * chain)
    model = GPTModel(config, TPInfo.single(), pre_process=stage == 0,
                     post_process=stage == d - 1,
                     layer_numbers=range(stage * chain, (stage + 1) * chain)).train()
    weights = weight_storage_ptrs(model)
    gen = torch.Generator().manual_seed(0)
    batches = [{"text": sample_text(config, b, gen)} for _ in range(n)]
    inputs = [torch.randn(S, b, H, dtype=config.residual_dtype, requires_grad=True)
              for _ in range(n)]

    def run(i: int) -> torch.Tensor:
        if stage > 0:
            model.set_input_tensor(inputs[i])
        out, loss_fn = forward_step(iter([batches[i]]), model)
        return loss_fn(out)[0] if stage == d - 1 else out

    tracker = StashTracker(weights)       # the executor's count, microbatch by microbatch
    kept = []
    for i in range(n):
        with tracker.counting(i):
            kept.append(run(i))
    held: dict = {}                       # what the n in flight hold: distinct storages

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            held[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kept += [run(i) for i in range(n)]
    mask = model.encoder.layers[0].self_attention.core_attention._causal
    assert mask.dtype == torch.bool and mask.untyped_storage().nbytes() == S * S
    assert mask.untyped_storage().data_ptr() in held

    cm = CostModel(prof.model_spec(num_layers=d * chain), FAST, profile=prof)
    st = cm.stage_costs(Config(w=1, d=d, b=b, m=n, schedule="gpipe"))[stage]
    assert st.in_flight == n
    planned = st.activation_bytes + st.stash_bytes + st.shared_bytes
    assert sum(held.values()) == planned
    assert tracker.stats.peak_stashed_bytes == planned
    assert list(tracker.shared.values()) == [S * S]


def _dict_profile(dtype="bf16", **flags) -> Profile:
    data = make_profile()
    data["model"].update(dtype=dtype, **flags)
    return Profile(data)


def test_the_planner_accepts_refuses_and_notes():
    causal = _dict_profile()
    spec = causal.model_spec()
    wide, masked = (dataclasses.replace(spec, fp32_residual_connection=True),
                    dataclasses.replace(spec, reset_attention_mask=True))
    # a half-precision profile prices only its own stream
    with pytest.raises(ValueError, match="without --fp32-residual-connection, planning with "
                                         "it: profile with the flag"):
        CostModel(wide, FAST, profile=causal)
    flagged = _dict_profile(fp32_residual_connection=True)
    assert flagged.model_spec().fp32_residual_connection
    with pytest.raises(ValueError, match="with --fp32-residual-connection, planning without"):
        CostModel(spec, FAST, profile=flagged)
    CostModel(wide, FAST, profile=flagged)
    for fp32 in (_dict_profile("fp32"), _dict_profile("fp32", fp32_residual_connection=True)):
        CostModel(spec, FAST, profile=fp32)        # the stream is float32 either way
        CostModel(wide, FAST, profile=fp32)
    # a causal profile prices a masked plan, with a note on its times
    CostModel(masked, FAST, profile=causal)
    notes = causal.notes(masked)
    assert len(notes) == 1 and "causal kernel" in notes[0] and "\n" not in notes[0]
    assert causal.notes(spec) == []
    # a masked profile's times are the masked kernel's: causal plans are refused
    doc = _dict_profile(reset_attention_mask=True)
    assert doc.model_spec().reset_attention_mask and "document attention mask" in doc.describe()
    with pytest.raises(ValueError, match="taken with --reset-attention-mask"):
        CostModel(spec, FAST, profile=doc)
    CostModel(masked, FAST, profile=doc)
    assert doc.notes(masked) == []


def test_plan_cli_takes_the_flags_from_the_profile_and_notes(tmp_path, capsys):
    from tools.plan import run

    path = tmp_path / "p.json"
    plan = ["--profile", str(path), "--cluster", "cpu", "--num-gpus", "2",
            "--max-batch-size", "8", "--top", "1"]
    for flags in ({"reset_attention_mask": True}, {"fp32_residual_connection": True}):
        data = make_profile()
        data["model"].update(dtype="bf16", **flags)
        path.write_text(json.dumps(data))
        assert run(plan) == 0
        out = capsys.readouterr().out
        cmd = out.strip().splitlines()[-1]
        flag = "--" + next(iter(flags)).replace("_", "-")
        assert cmd.startswith("torchrun") and flag in cmd and "note:    --profile" not in out
    data = make_profile()
    data["model"]["dtype"] = "bf16"
    path.write_text(json.dumps(data))
    assert run(plan + ["--reset-attention-mask"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note:    --profile")]
    assert len(notes) == 1 and "causal kernel" in notes[0]
    assert "--reset-attention-mask" in out.strip().splitlines()[-1]
    assert run(plan + ["--fp32-residual-connection"]) == 2
    err = capsys.readouterr().err
    assert "without --fp32-residual-connection" in err and "profile with the flag" in err


def test_plan_json_holds_the_profile_notes(tmp_path, capsys):
    """The notes tools/plan.py prints about what a profile's costs leave out (here: a
    causal profile timing a --reset-attention-mask plan) are in its --json output too,
    one string each under ``profile_notes``; none, an empty list."""
    from tools.plan import run

    path, out = tmp_path / "p.json", tmp_path / "plan.json"
    data = make_profile()
    data["model"]["dtype"] = "bf16"
    path.write_text(json.dumps(data))
    plan = ["--profile", str(path), "--cluster", "cpu", "--num-gpus", "2",
            "--max-batch-size", "8", "--top", "1", "--json", str(out)]
    assert run(plan + ["--reset-attention-mask"]) == 0
    printed = [line[len("note:    "):] for line in capsys.readouterr().out.splitlines()
               if line.startswith("note:    --profile")]
    notes = json.loads(out.read_text())["profile_notes"]
    assert len(printed) == 1 and notes == printed and "causal kernel" in notes[0]
    assert run(plan) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["profile_notes"] == []


def test_an_old_profile_without_the_fields_loads_as_causal_without_the_flag():
    data = make_profile()
    assert "fp32_residual_connection" not in data["model"]
    prof = Profile(copy.deepcopy(data))
    spec = prof.model_spec()
    assert not spec.fp32_residual_connection and not spec.reset_attention_mask
    assert prof.attention_mask_bytes(2) == 0
    assert prof.stage_stash_bytes(2, False, False, 2) == prof.stage(2, False, False, 2).stash_bytes
    CostModel(spec, FAST, profile=prof)
    data["model"]["reset_attention_mask"] = "yes"
    with pytest.raises(ValueError, match="model.reset_attention_mask must be bool"):
        Profile(data)

"""What does the safe checkpoint format cost?  (CPU, one process, local disk)

    PYTHONPATH=. python bench/checkpoint_io.py [--quick] [--rounds 3] [--out-dir DIR]

One rank's ``model_optim_rng`` payload of a GPT (model weights, a 2BW shadow copy, Adam
moments with int parameter ids, fp32 step counters, scheduler and engine state) is saved
and loaded in two formats, alternating A B A B so both see the same machine load:

* A, the previous format: ``torch.save`` of the whole dict and ``fsync`` (as the previous
  ``save_payload`` did), ``torch.load`` (pickle);
* B, this version: ``save_payload`` (safetensors + JSON) plus the sha256 of both files
  that goes into the manifest, and ``load_payload`` with that manifest verified.

Both loads must return equal tensors (checked).  Medians over the rounds are reported.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import bench_command, format_table, median, write_results  # noqa: E402
from megatron.checkpoint_files import (file_entries, load_payload,  # noqa: E402
                                       write_manifest)
from megatron.checkpointing import save_payload  # noqa: E402

FULL = {"layers": 12, "hidden": 512, "vocab": 32768}    # about 45M parameters
QUICK = {"layers": 2, "hidden": 128, "vocab": 4096}


def gpt_payload(layers: int, hidden: int, vocab: int) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model: Dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"layers.{i}."
        model[p + "attention.query_key_value.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        model[p + "attention.dense.weight"] = torch.randn(hidden, hidden, generator=g)
        model[p + "mlp.dense_h_to_4h.weight"] = torch.randn(4 * hidden, hidden, generator=g)
        model[p + "mlp.dense_4h_to_h.weight"] = torch.randn(hidden, 4 * hidden, generator=g)
        for name in ("input_layernorm", "post_attention_layernorm"):
            model[p + name + ".weight"] = torch.ones(hidden)
            model[p + name + ".bias"] = torch.zeros(hidden)
    params = list(model.values())
    state = {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(t.shape, generator=g),
                 "exp_avg_sq": torch.rand(t.shape, generator=g)} for i, t in enumerate(params)}
    return {"iteration": 100, "model": model,
            "model_shadow": {k: v + 1e-3 for k, v in model.items()},
            "optimizer": {"optimizer": {"state": state, "param_groups": [
                {"params": list(range(len(params))), "lr": 1e-4, "betas": (0.9, 0.999)}]}},
            "engine": {"iteration": 100, "batch_scales": {100: 1.0, 101: 1.0}},
            "lr_scheduler": {"num_steps": 800, "max_lr": 1e-4}}


def _size(paths) -> int:
    return sum(os.path.getsize(p) for p in paths)


def run(model: Dict[str, int], rounds: int) -> Dict[str, Any]:
    payload = gpt_payload(**model)
    n_params = sum(t.numel() for t in payload["model"].values())
    work = tempfile.mkdtemp(prefix="ckpt_io_")
    times: Dict[str, list] = {k: [] for k in ("pickle_save", "pickle_load", "safe_save",
                                               "safe_hash", "safe_load")}
    sizes = {}
    try:
        for r in range(rounds):
            old = os.path.join(work, f"old{r}.pt")
            t0 = time.perf_counter()
            torch.save(payload, old)
            with open(old, "rb") as fh:  # the previous save_payload synced too
                os.fsync(fh.fileno())
            t1 = time.perf_counter()
            back_old = torch.load(old, weights_only=True)  # our own file; the old format's load path
            t2 = time.perf_counter()
            times["pickle_save"].append(t1 - t0)
            times["pickle_load"].append(t2 - t1)
            sizes["pickle"] = os.path.getsize(old)

            base = os.path.join(work, f"iter{r}")
            os.makedirs(os.path.join(base, "mp_rank_00"))
            stem = os.path.join(base, "mp_rank_00", "model_optim_rng")
            t0 = time.perf_counter()
            written = save_payload(payload, stem)
            t1 = time.perf_counter()
            write_manifest(base, 100, {"tensor": 1, "pipeline": 1, "data": 1},
                           file_entries(base, written))
            t2 = time.perf_counter()
            back_new = load_payload(stem)
            t3 = time.perf_counter()
            times["safe_save"].append(t1 - t0)
            times["safe_hash"].append(t2 - t1)
            times["safe_load"].append(t3 - t2)
            sizes["safe"] = _size(written)
            for k, v in back_old["model"].items():
                assert torch.equal(v, back_new["model"][k]), k
            assert back_new["optimizer"]["optimizer"]["state"].keys() == \
                back_old["optimizer"]["optimizer"]["state"].keys()
            os.remove(old)
            shutil.rmtree(base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: median(v) for k, v in times.items()}
    return {"model": model, "parameters": n_params, "rounds": rounds, "bytes": sizes,
            "seconds": med, "all_seconds": times,
            "save_ratio": (med["safe_save"] + med["safe_hash"]) / med["pickle_save"],
            "load_ratio": med["safe_load"] / med["pickle_load"]}


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    res = run(QUICK if args.quick else FULL, 2 if args.quick else args.rounds)
    s, b = res["seconds"], res["bytes"]
    rows = [["pickle (torch.save/load)", b["pickle"] / 2**20, s["pickle_save"], None,
             s["pickle_load"]],
            ["safetensors + JSON + sha256", b["safe"] / 2**20, s["safe_save"], s["safe_hash"],
             s["safe_load"]]]
    print(format_table(["format", "MiB", "save s", "hash s", "load s (verified)"], rows,
                       title=f"one rank's checkpoint payload, {res['parameters'] / 1e6:.1f}M "
                             f"parameters (+ shadow copy + Adam state), median of "
                             f"{res['rounds']} rounds"))
    print(f"safe/pickle: save+hash {res['save_ratio']:.2f}x, load {res['load_ratio']:.2f}x")
    path = write_results("checkpoint_io", {"command": bench_command("bench/checkpoint_io.py",
                                                                    argv),
                                           "quick": args.quick, **res}, args.out_dir)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()

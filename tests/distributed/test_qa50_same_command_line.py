"""Every rank of a job must run the same command line.  Two nodes started with different
flags (another --num-layers, another --seed, --data-path on one node only) trained
silently and inconsistently before: the replicas had different weights, or the stages
disagreed on the layer split.  Now every rank stops at start-up with one error line
naming the flags and which ranks had which value."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "96",
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3"]


def _initialize(rank: int, world: int, argv_per_rank):
    from megatron.arguments import parse_and_validate
    from megatron.errors import UserError
    from megatron.initialize import initialize_distributed

    args, cfg = parse_and_validate(list(argv_per_rank[rank]))
    try:
        groups, _ = initialize_distributed(cfg.parallel)
    except UserError as err:
        return {"error": str(err), "alike": getattr(err, "every_rank_alike", False)}
    out = {"describe": groups.describe()}
    groups.destroy()
    return out


def test_different_flags_on_two_nodes_stop_every_rank_with_one_error():
    # node 0 (ranks 0-1) and node 1 (ranks 2-3) of a t=1, d=2, w=2 job: node 1's
    # command line says 4 layers and another seed, and names a local-rank (legacy
    # launchers pass one per rank: it may differ)
    node0 = TINY + ["--pipeline-model-parallel-size", "2"]
    node1 = [a if a != "2" or i != 1 else "4" for i, a in enumerate(TINY)] + [
        "--pipeline-model-parallel-size", "2", "--seed", "7"]
    argv = [node0 + ["--local-rank", "0"], node0 + ["--local-rank", "1"],
            node1 + ["--local-rank", "0"], node1 + ["--local-rank", "1"]]
    results = run_distributed(_initialize, world_size=4, args=(argv,), timeout=60)
    messages = {r.get("error") for r in results}
    assert len(messages) == 1 and None not in messages, results
    message = messages.pop()
    assert all(r["alike"] for r in results)
    assert "--num-layers is 2 on ranks 0-1 and 4 on ranks 2-3" in message, message
    assert "--seed is 1234 on ranks 0-1 and 7 on ranks 2-3" in message, message
    assert "local-rank" not in message and "\n" not in message


def test_same_flags_with_per_rank_local_rank_pass():
    # and a --data-cache-path of each node's own (node-local disks mounted elsewhere)
    argv = [TINY + ["--tensor-model-parallel-size", "2", "--local-rank", str(r % 2),
                    "--data-cache-path", f"/tmp/cache-of-node-{r}"]
            for r in range(2)]
    results = run_distributed(_initialize, world_size=2, args=(argv,), timeout=60)
    assert [r.get("error") for r in results] == [None, None], results
    assert results[1]["describe"].startswith("rank 1: tensor 1/2")


def test_data_path_on_one_rank_only_is_named(tmp_path):
    prefix = _tiny_corpus(tmp_path)
    with_data = [a for a in TINY if a != "--mock-data"] + ["--data-path", prefix]
    results = run_distributed(_initialize, world_size=2, args=([TINY, with_data],),
                              timeout=60)
    message = results[0].get("error")
    assert message is not None and message == results[1].get("error"), results
    assert "--data-path is None on rank 0 and" in message and "on rank 1" in message
    assert "--mock-data is True on rank 0 and False on rank 1" in message


def _tiny_corpus(tmp_path: Path) -> str:
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        builder.add_item(rng.integers(0, 90, size=40))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_two_processes_with_different_seeds_exit_2_naming_the_flag():
    """End to end, as two hand-launched "nodes" (RANK/WORLD_SIZE/MASTER_* by hand, local
    rank 0 each): both exit 2 at start-up with the error line; neither trains."""
    port = free_port()
    procs = []
    for rank, seed in ((0, "1234"), (1, "99")):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                   LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "pretrain_gpt.py"), *TINY, "--seed", seed,
             "--distributed-timeout-minutes", "1"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, err
        assert "--seed is 1234 on rank 0 and 99 on rank 1" in lines[0], err
        assert "Traceback" not in err and "iteration" not in out

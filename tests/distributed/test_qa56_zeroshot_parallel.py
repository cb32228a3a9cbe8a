"""Zero-shot GPT evaluation on two gloo ranks gives the single-process numbers: WikiText
perplexity and LAMBADA accuracy (strict and not) at pipeline depth 2, and LAMBADA at
tensor parallel 2 (the argmax is taken over the gathered vocabulary)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.unit.test_tasks_wikitext import MODEL, TEXT


def _ranks(rank, world, argvs):
    from tasks.main import main

    out = []
    for argv in argvs:
        r = main(argv)
        out.append(None if r is None else vars(r))
    return out


def test_zeroshot_numbers_at_pipeline_depth_2_and_tensor_parallel_2(tmp_path):
    import pretrain_gpt
    from tasks.main import main

    torch.set_num_threads(1)
    ckpt = str(tmp_path / "gpt")
    pretrain_gpt.main(MODEL + ["--mock-data", "--micro-batch-size", "2",
                               "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-2",
                               "--eval-iters", "0", "--save", ckpt, "--log-interval", "100"])
    wiki = tmp_path / "wiki.tokens"
    wiki.write_text(TEXT)
    from tests.unit.test_qa56_lambada import CONTEXTS, _greedy, _tok
    from tests.unit.test_qa56_wikitext import _model

    model, tok = _model(ckpt), _tok()   # passages ending in the model's own predictions
    texts = [c + tok.detokenize(_greedy(model, tok.tokenize(c), 3)) for c in CONTEXTS]
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts + ["a b"]))
    common = MODEL + ["--load", ckpt, "--micro-batch-size", "2"]
    runs = [common + ["--task", "WIKITEXT103", "--valid-data", str(wiki),
                      "--overlapping-eval", "5"],
            common + ["--task", "LAMBADA", "--valid-data", str(lam)],
            common + ["--task", "LAMBADA", "--valid-data", str(lam), "--strict-lambada"]]
    single = [vars(main(argv)) for argv in runs]
    pp2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    results = run_distributed(_ranks, 2, args=([argv + pp2 for argv in runs]
                                               + [runs[1] + tp2],))
    assert all(r is None for r in results[0][:3])    # the first stage reports nothing
    last = results[1]
    wiki1, wiki2 = single[0], last[0]
    assert wiki2["num_tokens"] == wiki1["num_tokens"]
    assert wiki2["total_loss"] == pytest.approx(wiki1["total_loss"], rel=1e-10)
    assert wiki2["adjusted_ppl"] == pytest.approx(wiki1["adjusted_ppl"], rel=1e-9)
    assert single[1]["correct"] >= 3     # not a trivial 0 of 6
    assert last[1] == single[1] and last[3] == single[1]
    assert last[2] == single[2]
    assert results[0][3] == last[3]   # both tensor ranks hold the last stage

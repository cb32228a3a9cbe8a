"""--task LAMBADA (Megatron-LM's tasks/zeroshot_gpt): the context/target split at the last
word (strict and not), the sample layout, accuracy against a plain recomputation, the
output line, and one clear error for a bad --valid-data file."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.unit.test_qa56_wikitext import _model
from tests.unit.test_tasks_wikitext import MODEL

CONTEXTS = ["the cat sat", "it was dark", "she said hi", "x y",
            "we walked along the river bank to the"]   # the last: longer than 17 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import pretrain_gpt

    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("qa56l") / "gpt")
    pretrain_gpt.main(MODEL + ["--mock-data", "--micro-batch-size", "2",
                               "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-2",
                               "--eval-iters", "0", "--save", path, "--log-interval", "100"])
    return path


def _tok():
    from megatron.tokenizer.tokenizer import CharTokenizer
    return CharTokenizer()


def test_split_at_the_last_word():
    from tasks.zeroshot_gpt.datasets import lambada_split

    tok = _tok()
    text = "he opened the door  and saw  Bob"
    # non-strict: the whole text tokenized, its last token the target
    ctx, tgt = lambada_split(text, tok, strict=False)
    assert ctx == tok.tokenize(text)[:-1] and tgt == tok.tokenize("b")
    # strict: the whole last word, as " " + word; the context stripped before it
    ctx, tgt = lambada_split(text, tok, strict=True)
    assert ctx == tok.tokenize("he opened the door  and saw") and tgt == tok.tokenize(" Bob")


def test_sample_layout_pads_and_masks_the_target_only():
    from tasks.zeroshot_gpt.datasets import LambadaDataset

    ds = LambadaDataset([([1, 2, 3], [4, 5]), (list(range(10, 30)), [7])], 8, pad_id=0)
    s = ds[0]
    assert s["text"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 0]
    # position i predicts text[i + 1]: positions 2 and 3 predict 4 and 5
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    s = ds[1]   # 21 tokens > 9: the context is cut from the left, the target kept
    assert s["text"].tolist() == list(range(22, 30)) + [7]
    assert s["loss_mask"].tolist() == [0] * 7 + [1]
    assert ds.truncated == 1


def _greedy(model, tokens, n):
    out = list(tokens)
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor(out[-16:]).unsqueeze(0)
            out.append(int(model(t, torch.arange(t.shape[1]).unsqueeze(0), None)[0, -1].argmax()))
    return out[len(tokens):]


def _direct_correct(model, samples, seq):
    """Plain recomputation: one forward over context + target (its last seq + 1
    tokens), correct when the argmax at each target position is the target token."""
    correct = 0
    for ctx, tgt in samples:
        toks = torch.tensor((ctx + tgt)[-(seq + 1):])
        with torch.no_grad():
            logits = model(toks[:-1].unsqueeze(0), torch.arange(len(toks) - 1).unsqueeze(0),
                           None)[0]
        pred = logits.argmax(-1)[len(toks) - 1 - len(tgt):]
        correct += int(pred.tolist() == tgt)
    return correct


def test_accuracy_equals_a_plain_recomputation(ckpt, tmp_path, capsys):
    from tasks.main import main
    from tasks.zeroshot_gpt.datasets import lambada_split

    torch.set_num_threads(1)
    model, tok = _model(ckpt), _tok()
    passages = []
    for ctx in CONTEXTS:   # the model's own next tokens (correct) and a wrong last one
        nxt = _greedy(model, tok.tokenize(ctx), 3)
        right = ctx + tok.detokenize(nxt)
        passages += [right, right[:-1] + ("q" if right[-1] != "q" else "z")]
    passages.append("a b")
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages) + "\n")
    for strict in (False, True):
        samples = [lambada_split(p, tok, strict) for p in passages]
        expected = _direct_correct(model, samples, 16)
        result = main(MODEL + ["--task", "LAMBADA", "--valid-data", str(path), "--load", ckpt,
                               "--micro-batch-size", "2", "--global-batch-size", "4",
                               "--log-interval", "1"] + (["--strict-lambada"] if strict else []))
        out = capsys.readouterr().out.splitlines()
        assert result.total == len(passages) and result.correct == expected, (strict, result)
        if not strict:
            assert expected >= 3   # the greedy passages (not the long one: cut)
        n = len(passages)
        line = (f" validation results on LAMBADA | number correct: {float(expected):.4E} | "
                f"total examples: {float(n):.4E} | avg accuracy: {expected / n:.4E}")
        i = out.index(line)
        assert out[i - 1] == out[i + 1] == "-" * (len(line) + 1)
        cut = sum(len(c) + len(t) > 17 for c, t in samples)
        assert cut == 2 and f" > found {n} samples. ({cut} longer than --seq-length 16 + 1 " \
               f"tokens: their context is cut from the left)" in out
        assert [ln for ln in out if ln.startswith("> working on")] == [
            f"> working on iteration: {i}" for i in range(-(-n // 4))]


@pytest.mark.parametrize("case", ["no text", "not json", "empty text", "missing", "empty file",
                                  "one word"])
def test_bad_lambada_file_is_one_error_naming_it(ckpt, tmp_path, capsys, case):
    from megatron.entry import run_entry_point
    from tasks.main import main

    path = tmp_path / "lambada.jsonl"
    body = {"no text": '{"text": "a b c"}\n{"passage": "x y"}\n',
            "not json": '{"text": "a b c"}\nhello\n',
            "empty text": '{"text": "a b c"}\n{"text": "  "}\n',
            "missing": None, "empty file": "\n",
            "one word": '{"text": "a b c"}\n{"text": "word"}\n'}[case]
    if body is not None:
        path.write_text(body)
    with pytest.raises(SystemExit) as info:
        run_entry_point(main, MODEL + ["--task", "LAMBADA", "--valid-data", str(path),
                                       "--load", ckpt, "--micro-batch-size", "2",
                                       "--strict-lambada"])
    assert info.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1, err
    where = f"error: --valid-data {path}" + (":2:" if case not in ("missing", "empty file")
                                             else ":")
    assert err[0].startswith(where), err


def test_strict_lambada_with_wikitext_is_a_warning(ckpt, tmp_path, capsys):
    from tasks.main import main
    from tests.unit.test_tasks_wikitext import TEXT

    path = tmp_path / "wiki.tokens"
    path.write_text(TEXT)
    main(MODEL + ["--task", "WIKITEXT103", "--valid-data", str(path), "--load", ckpt,
                  "--micro-batch-size", "2", "--strict-lambada"])
    assert ("warning: --strict-lambada is ignored by --task WIKITEXT103 (it is for --task "
            "LAMBADA)") in capsys.readouterr().err

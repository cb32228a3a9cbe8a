"""Hugging Face export/import (megatron/hf_interop.py via tools/checkpoint_util.py):
transformers' models loaded from our export give our logits, and an imported GPT-2
gives transformers' logits (float32, max abs diff < 1e-4)."""
from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from megatron.checkpointing import save_payload  # noqa: E402
from megatron.config import ModelConfig  # noqa: E402
from megatron.errors import CheckpointError, UserError  # noqa: E402
from megatron.hf_layouts import qkv_hf_to_ours, qkv_ours_to_hf  # noqa: E402
from megatron.model.bert_model import BertModel  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402
from megatron.tensor_parallel import TPInfo  # noqa: E402
from tools.checkpoint_util import convert, main, merge_checkpoint, read_checkpoint  # noqa: E402

TP = TPInfo.single()
VOCAB = 96
GPT2_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gpt2")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                padded_vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0,
                layernorm_epsilon=1e-5, init_method_std=0.2)
    base.update(kw)
    return ModelConfig(**base)


def _save(root, model, cfg, data=None):
    model_cfg = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in cfg.__dict__.items()}
    base = os.path.join(root, "iter_0000004", "mp_rank_00")
    os.makedirs(base)
    save_payload({"iteration": 4, "layout": {"tensor": 1, "pipeline": 1, "data": 1},
                  "model": model.state_dict(),
                  "config": {"model": model_cfg,
                             "data": data or {"tokenizer_type": "NullTokenizer",
                                              "vocab_size": VOCAB,
                                              "make_vocab_size_divisible_by": 64}}},
                 os.path.join(base, "model_optim_rng"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    return root


def _ids(b=2, s=16, vocab=VOCAB):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(3))


def test_qkv_reordering_round_trips():
    w = torch.arange(3 * 8 * 5, dtype=torch.float64).reshape(24, 5)
    assert torch.equal(qkv_hf_to_ours(qkv_ours_to_hf(w, 4), 4), w)
    # ours: rows [head, (q, k, v), head_dim]; hf: [(q, k, v), head, head_dim]
    assert torch.equal(qkv_ours_to_hf(w, 4)[:2], w[:2])      # q of head 0
    assert torch.equal(qkv_ours_to_hf(w, 4)[2:4], w[6:8])    # q of head 1


@pytest.mark.parametrize("resplit,openai_gelu", [(False, False), (True, True)])
def test_gpt_export_loads_in_transformers_with_our_logits(tmp_path, capsys, resplit,
                                                          openai_gelu):
    cfg = _cfg(openai_gelu=openai_gelu)
    model = GPTModel(cfg, TP, seed=5).eval()
    src = _save(str(tmp_path / "ckpt"), model, cfg)
    if resplit:  # export merges any layout
        convert(src, str(tmp_path / "t2d2"), tp=2, pp=2)
        src = str(tmp_path / "t2d2")
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    assert "NullTokenizer" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.config.vocab_size == VOCAB
    # not GPT-2's tokenizer: no GPT-2 special ids (50256) outside this vocabulary
    with open(os.path.join(out, "config.json")) as fh:
        written = json.load(fh)
    assert written["bos_token_id"] is None and written["eos_token_id"] is None
    assert hf.config.activation_function == ("gelu_new" if openai_gelu else "gelu")
    ids = _ids()
    with torch.no_grad():
        ours = model(ids, None, None)[..., :VOCAB]
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_bert_export_loads_as_megatron_bert_with_our_logits(tmp_path):
    cfg = _cfg(num_tokentypes=2)
    model = BertModel(cfg, TP, seed=6).eval()
    src = _save(str(tmp_path / "bert"), model, cfg)
    out = str(tmp_path / "hf")
    main(["--load", src, "--to-hf", out])
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == \
        ["MegatronBertForPreTraining"]
    hf = transformers.MegatronBertForPreTraining.from_pretrained(out).eval()
    ids = _ids()
    types = torch.zeros_like(ids)
    types[:, 8:] = 1
    pad = torch.ones_like(ids)
    with torch.no_grad():
        lm, binary = model(ids, pad, types)
        res = hf(input_ids=ids, token_type_ids=types, attention_mask=pad)
    assert (lm[..., :VOCAB] - res.prediction_logits).abs().max().item() < 1e-4
    assert (binary - res.seq_relationship_logits).abs().max().item() < 1e-4


def test_gpt2_tokenizer_files_are_written(tmp_path):
    from megatron.hf_tokenizer_files import tokenizer_files

    data = {"tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": os.path.join(GPT2_DIR, "encoder.json"),
            "merge_file": os.path.join(GPT2_DIR, "vocab.bpe")}
    if not os.path.isfile(data["vocab_file"]):
        pytest.skip("shared GPT-2 vocabulary not available")
    note = tokenizer_files(data, str(tmp_path), 1024)
    assert "vocab.json" in note and "merges.txt" in note
    tok = transformers.GPT2Tokenizer.from_pretrained(str(tmp_path))
    assert tok("Hello world, it's me.")["input_ids"] == [15496, 995, 11, 340, 338, 502, 13]


def _hf_gpt2(tmp_path, act="gelu", tie=True):
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, activation_function=act, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
                                     bos_token_id=99, eos_token_id=99,
                                     tie_word_embeddings=tie)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases
        for name, p in hf.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path / "hf")
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("tp,pp,act", [(1, 1, "gelu"), (2, 2, "gelu_new")])
def test_gpt2_import_gives_transformers_logits(tmp_path, capsys, tp, pp, act):
    hf, path = _hf_gpt2(tmp_path, act)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out, "--target-tensor-parallel-size", str(tp),
          "--target-pipeline-parallel-size", str(pp), "--make-vocab-size-divisible-by", "64"])
    err = capsys.readouterr().err
    assert "--num-layers 2" in err and "--finetune" in err
    assert ("--openai-gelu" in err) == (act == "gelu_new")
    ckpt = read_checkpoint(out)
    assert (ckpt.tensor, ckpt.pipeline, ckpt.iteration) == (tp, pp, 0)
    cfg = _cfg(padded_vocab_size=128, openai_gelu=act == "gelu_new")
    model = GPTModel(cfg, TP, seed=1).eval()
    model.load_state_dict(merge_checkpoint(ckpt))
    ids = _ids(vocab=100)
    with torch.no_grad():
        ours = model(ids, None, None)[..., :100]
        theirs = hf(ids).logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_gpt2_with_its_own_lm_head_imports_untied(tmp_path, capsys):
    """tie_word_embeddings=false: the lm_head becomes our untied output layer
    (--untie-embeddings-and-output-weights), and exports back as GPT-2's lm_head."""
    hf, path = _hf_gpt2(tmp_path, tie=False)
    with torch.no_grad():
        hf.lm_head.weight.add_(0.5)  # not the word embedding
    hf.save_pretrained(path)
    out = str(tmp_path / "ours")
    main(["--from-hf", path, "--save", out, "--target-tensor-parallel-size", "2",
          "--target-pipeline-parallel-size", "2", "--make-vocab-size-divisible-by", "64"])
    assert "--untie-embeddings-and-output-weights" in capsys.readouterr().err
    cfg = _cfg(padded_vocab_size=128, untie_embeddings_and_output_weights=True)
    model = GPTModel(cfg, TP, seed=1).eval()
    model.load_state_dict(merge_checkpoint(read_checkpoint(out)))
    ids = _ids(vocab=100)
    with torch.no_grad():
        assert (model(ids, None, None)[..., :100] - hf(ids).logits).abs().max().item() < 1e-4
    main(["--load", out, "--to-hf", str(tmp_path / "back")])
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.tie_word_embeddings is False
    assert torch.equal(back.lm_head.weight, hf.lm_head.weight)


def test_import_refusals(tmp_path, capsys):
    _, path = _hf_gpt2(tmp_path, act="relu")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--from-hf", path, "--save", str(tmp_path / "o1")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "activation_function 'relu'" in err[0]
    # a pickle that runs code is refused (weights_only), not executed
    evil = tmp_path / "evil"
    evil.mkdir()
    json.dump({"model_type": "gpt2", "n_head": 4, "n_layer": 1, "n_embd": 8, "vocab_size": 10,
               "n_positions": 8, "activation_function": "gelu"}, open(evil / "config.json", "w"))
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(evil / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"wte.weight": Evil()}, fh)
    with pytest.raises(CheckpointError, match="weights_only"):
        from megatron.hf_import import import_hf
        import_hf(str(evil), str(tmp_path / "o2"))
    assert not marker.exists()
    with pytest.raises(UserError, match="model_type 'gpt2', 'llama', 'qwen2' or 'qwen3', "
                                         "found 't5'"):
        json.dump({"model_type": "t5"}, open(evil / "config.json", "w"))
        import_hf(str(evil), str(tmp_path / "o3"))

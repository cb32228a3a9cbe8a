"""Hostile or broken files a user is handed: datasets, index caches, checkpoints, Hugging
Face directories, tokenizer files, finetuning data, traces and profiles.  Each must give
one ``UserError`` line naming the file (and the flag, where there is one) and what was
expected: never a traceback, a silent wrong result or an unpickled object."""
from __future__ import annotations

import json
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.checkpoint_files import (TRACKER, load_payload, read_manifest, read_tracker,
                                       write_manifest)
from megatron.checkpoint_load import check_model_payload, load_checkpoint
from megatron.checkpoint_shape import check_state_fits
from megatron.checkpointing import save_payload
from megatron.data.indexed_dataset import IndexedDatasetBuilder
from megatron.errors import CheckpointError, DataError, UserError
from megatron.parallel_state import ParallelGroups

DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _dataset(prefix, docs, dtype=np.uint16):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ------------------------------------------------------------------------ indexed datasets
def test_float_token_file_is_refused_not_cast(tmp_path):
    from megatron.data.dataset_utils import open_prefix

    prefix = _dataset(tmp_path / "f", [np.random.rand(20) * 50] * 4, np.float32)
    with pytest.raises(DataError, match=r"--data-path .*f\.idx declares float32.*integer"):
        open_prefix(prefix)


def test_corrupt_gpt_index_cache_is_rebuilt(tmp_path, capsys):
    from megatron.data.gpt_dataset import GPTDataset
    from megatron.data.indexed_dataset import IndexedDataset

    rng = np.random.default_rng(0)
    prefix = _dataset(tmp_path / "d", [rng.integers(0, 100, 30) for _ in range(10)])
    ds = IndexedDataset(prefix)
    docs = np.arange(10)
    first = GPTDataset("train", ds, docs, 12, 8, 1, str(tmp_path / "cache"), vocab_size=100)
    want = [first[i]["text"].copy() for i in range(12)]
    for pattern, column in (("shuffle_idx", None), ("sample_idx", 1), ("doc_idx", None)):
        path = next(p for p in (tmp_path / "cache").iterdir() if p.name.endswith(f"{pattern}.npy"))
        arr = np.load(path)
        if column is None:
            arr[:] = 10 ** 6
        else:
            arr[:, column] = 10 ** 6
        np.save(path, arr)
        again = GPTDataset("train", ds, docs, 12, 8, 1, str(tmp_path / "cache"), vocab_size=100)
        assert not again.index_cache_hit
        assert all(np.array_equal(again[i]["text"], want[i]) for i in range(12))
        assert "point outside" in capsys.readouterr().err


def test_corrupt_bert_mapping_cache_is_rebuilt(tmp_path, capsys):
    from megatron.data.bert_dataset import MaskingConfig, _mapping
    from megatron.data.indexed_dataset import IndexedDataset

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{tmp_path / 's'}.bin", np.uint16)
    for _ in range(6):
        for _ in range(4):
            builder.add_item(rng.integers(5, 100, 6))
        builder.end_document()
    builder.finalize(f"{tmp_path / 's'}.idx")
    ds = IndexedDataset(str(tmp_path / "s"))
    docs = np.asarray(ds.doc_idx, dtype=np.int64)
    args = ("train", ds, docs, 10, 32, 1, MaskingConfig(), str(tmp_path / "cache"))
    mapping, hit = _mapping(*args)
    path = next((tmp_path / "cache").glob("*_bert_mapping.npy"))
    bad = np.array(mapping)
    bad[:, 1] = 10 ** 6
    np.save(path, bad)
    again, hit = _mapping(*args)
    assert not hit and np.array_equal(again, mapping)
    assert "points outside" in capsys.readouterr().err


def test_a_directory_where_the_bin_should_be_is_named_as_such(tmp_path):
    from megatron.arguments import parse_args, validate_args

    prefix = _dataset(tmp_path / "d", [[1, 2, 3]])
    os.remove(prefix + ".bin")
    os.mkdir(prefix + ".bin")
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--vocab-size", "128", "--data-path", prefix]
    with pytest.raises(UserError, match=r"d\.bin is not a regular file"):
        validate_args(parse_args(argv), 1)


# ------------------------------------------------------------------------------ tokenizers
def test_gpt2_vocab_ids_outside_the_vocabulary_are_refused(tmp_path):
    from megatron.tokenizer import GPT2BPETokenizer

    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    for encoder, found in (({"<|endoftext|>": 5, "a": 0}, "id 5"),
                           ({"<|endoftext|>": 0, "a": "1"}, "id '1'")):
        (tmp_path / "v.json").write_text(json.dumps(encoder))
        with pytest.raises(ValueError, match=f"--vocab-file .*v.json.*{found}.*integer ids"):
            GPT2BPETokenizer(str(tmp_path / "v.json"), str(merges), fast=False)
    (tmp_path / "v.json").write_text(DEEP_JSON)
    with pytest.raises(ValueError, match="--vocab-file .*v.json.*encoder.json"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), str(merges), fast=False)


def test_bad_tokenizer_file_is_a_user_error_before_any_process_group(tmp_path):
    from megatron.arguments import parse_and_validate
    from megatron.training import initialize_megatron

    (tmp_path / "v.json").write_text("{not json")
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    args, cfg = parse_and_validate(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(tmp_path / "v.json"), "--merge-file", str(tmp_path / "m.txt")],
        world_size=1)
    with pytest.raises(UserError, match="--vocab-file .*v.json"):
        initialize_megatron(args, cfg)
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"-3", b"9" * 5000, None],
                         ids=["binary", "negative", "huge", "directory"])
def test_garbage_tracker_is_one_error_naming_it(tmp_path, content):
    path = tmp_path / TRACKER
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=f"{TRACKER}: expected .*iteration number"):
        read_tracker(str(tmp_path))


@pytest.mark.parametrize("change, found", [
    (lambda m: m.update(layout="x"), "'layout'"),
    (lambda m: m["files"].update({"a.json": "x"}), "the entry of a.json"),
    (lambda m: m["files"].update({"a.json": {"bytes": "1", "sha256": "0"}}), "the entry of a.json"),
], ids=["layout", "entry", "entry-types"])
def test_manifest_of_wrong_types_is_one_error(tmp_path, change, found):
    write_manifest(str(tmp_path), 1, {"tensor": 1, "pipeline": 1})
    doc = json.loads((tmp_path / "manifest.json").read_text())
    change(doc)
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=f"manifest.json: expected {found}"):
        read_manifest(str(tmp_path))
    (tmp_path / "manifest.json").write_text(DEEP_JSON)
    with pytest.raises(CheckpointError, match="manifest.json: not a readable manifest"):
        read_manifest(str(tmp_path))


def test_deeply_nested_payload_json_is_one_error(tmp_path):
    stem = str(tmp_path / "p")
    save_payload({"a": torch.ones(1)}, stem)
    with open(stem + ".json", "w") as fh:
        fh.write(DEEP_JSON)
    with pytest.raises(CheckpointError, match=r"p\.json: not a readable checkpoint JSON"):
        load_payload(stem)
    # nested less than json's limit but deeper than the decoder's: still one error
    with open(stem + ".json", "w") as fh:
        fh.write('{"format": "megatron-pd2bw-payload", "version": 2, "tree": '
                 + '{"__tuple__": [' * 900 + "1" + "]}" * 900 + "}")
    try:
        load_payload(stem)
    except CheckpointError as exc:
        assert "p.json" in str(exc)


def _write_checkpoint(root, payload, iteration=2):
    rank = root / f"iter_{iteration:07d}" / "mp_rank_00"
    rank.mkdir(parents=True)
    save_payload(payload, str(rank / "model_optim_rng"))
    (root / TRACKER).write_text(str(iteration))
    return rank / "model_optim_rng.json"


def _good_payload():
    return {"iteration": 2, "consumed_train_samples": 8, "consumed_valid_samples": 0,
            "layout": {"tensor": 1, "pipeline": 1, "data": 1, "layers": None},
            "model": {"w": torch.ones(2)}, "model_shadow": None, "config": {"model": {}}}


@pytest.mark.parametrize("change, expected", [
    (lambda p: p.pop("model"), "'model' mapping parameter names to tensors"),
    (lambda p: p.update(model={"w": 3}), "'model' mapping"),
    (lambda p: p.update(iteration="abc"), "'iteration' an integer >= 0"),
    (lambda p: p.pop("consumed_train_samples"), "'consumed_train_samples'"),
    (lambda p: p.update(layout=5), "'layout' an object"),
    (lambda p: p.update(config={"model": [1]}), "'config.model' an object"),
    (lambda p: p["layout"].update(layers="x"), "'layout.layers'"),
])
def test_hand_edited_payload_is_one_error_naming_the_file(tmp_path, change, expected):
    payload = _good_payload()
    change(payload)
    where = _write_checkpoint(tmp_path, payload)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(tmp_path), ParallelGroups.single())
    assert str(where) in str(info.value) and expected in str(info.value)


def test_payload_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="p.json: expected a checkpoint object, found list"):
        save_payload([1], str(tmp_path / "p"))
        check_model_payload(load_payload(str(tmp_path / "p")), str(tmp_path / "p"))


def test_tools_read_checks_the_payload_too(tmp_path):
    from megatron.checkpoint_merge import read_checkpoint

    payload = _good_payload()
    payload["config"]["model"]["num_layers"] = "two"
    _write_checkpoint(tmp_path, payload)
    with pytest.raises(CheckpointError, match="num_layers 'two'; expected a positive integer"):
        read_checkpoint(str(tmp_path))


def test_state_of_another_shape_is_one_line_before_load_state_dict():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {k: torch.zeros(*(s + 1 for s in v.shape)) for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        check_state_fits("--load ck", state, module)
    text = str(info.value)
    assert text.startswith("--load ck: the checkpoint does not fit this model: 0.weight is "
                           "(4, 5) in the checkpoint, (3, 4) here") and "(and 1 more)" in text
    with pytest.raises(CheckpointError, match="1.bias is missing from the checkpoint"):
        check_state_fits("--load ck", {k: v for k, v in module.state_dict().items()
                                       if k != "1.bias"}, module)
    check_state_fits("--load ck", dict(module.state_dict()), module)


def test_checkpoint_of_another_task_names_the_heads_and_the_way_round():
    """--load of an MNLI checkpoint at RACE: the body fits, the heads differ; the line
    names both heads and --pretrained-checkpoint, not the shape flags."""
    def model(head: str, outputs: int) -> torch.nn.Module:
        m = torch.nn.Module()
        m.encoder = torch.nn.Linear(4, 4)
        setattr(m, head, torch.nn.Linear(4, outputs))
        return m
    mnli, race = model("classification_head", 3), model("multichoice_head", 1)
    with pytest.raises(CheckpointError) as info:
        check_state_fits("--load ck", dict(mnli.state_dict()), race)
    text = str(info.value)
    assert ("output heads (classification_head) are not this model's (multichoice_head)"
            in text and "--pretrained-checkpoint" in text and "--num-layers" not in text)
    wider = model("classification_head", 3)
    wider.encoder = torch.nn.Linear(4, 5)  # the body differs too: the shape message
    with pytest.raises(CheckpointError, match="does not fit this model: encoder.weight"):
        check_state_fits("--load ck", dict(wider.state_dict()), race)


def test_resume_with_another_optimizer_or_rng_state_is_one_error(monkeypatch, tmp_path):
    """maybe_load turns a restore failure (here: ValueError of the optimizer, a malformed
    RNG state) into a CheckpointError naming --load, not a traceback."""
    import megatron.training_checkpoint as training
    from megatron.arguments import parse_and_validate

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
            "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr",
            "1e-3", "--mock-data", "--vocab-size", "128", "--load", str(tmp_path)]
    _, cfg = parse_and_validate(argv, world_size=1)
    module = torch.nn.Linear(2, 2)
    payload = {"iteration": 2, "consumed_train_samples": 4, "consumed_valid_samples": 0,
               "model": dict(module.state_dict()), "optimizer": {"meta": None},
               "rng_state": None, "lr_scheduler": None, "config": {}}
    monkeypatch.setattr(training, "load_for_run", lambda *a, **k: (payload, None))
    engine = SimpleNamespace(model=module, latest_buffer=0, shadow_buffer=0,
                             weights=SimpleNamespace(install=lambda b: None, num_buffers=1),
                             set_iteration=lambda i: None)

    class Optimizer:
        def load_state_dict(self, sd):
            raise ValueError("optimizer checkpoint was saved with --optimizer adam, this run "
                             "uses sgd")

        def reload_model_params(self, params):
            pass

    with pytest.raises(CheckpointError, match=f"--load {tmp_path}: cannot restore the optimizer "
                                              f"state of iteration 2: .*--optimizer adam"):
        training.maybe_load(cfg, ParallelGroups.single(), engine, Optimizer(), None)
    # the optimizer restores, the engine's state does not: named as the engine's
    class Restores(Optimizer):
        def load_state_dict(self, sd):
            pass

    payload["engine"] = {"batch_scales": {}}
    engine.load_state_dict = lambda sd: sd["iteration"]
    with pytest.raises(CheckpointError, match="cannot restore the pipeline engine's state of "
                                              "iteration 2 .*KeyError: 'iteration'"):
        training.maybe_load(cfg, ParallelGroups.single(), engine, Restores(), None)
    payload.pop("engine")
    payload.update(optimizer=None, rng_state={"cpu": "garbage"})
    engine.weights.params = lambda b: []
    # no optimizer state at iteration 2 (--no-save-optim): only with --no-load-optim
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        training.maybe_load(cfg, ParallelGroups.single(), engine, Optimizer(), None)
    _, cfg = parse_and_validate(argv + ["--no-load-optim"], world_size=1)
    with pytest.raises(CheckpointError, match="cannot restore the random number generator"):
        training.maybe_load(cfg, ParallelGroups.single(), engine, Optimizer(), None)
    payload.update(rng_state=None, model={"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="does not fit this model: weight is"):
        training.maybe_load(cfg, ParallelGroups.single(), engine, Optimizer(), None)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("protocol", [2, 4])
def test_legacy_pickle_is_refused_with_its_reason_even_when_allowed(tmp_path, protocol, capsys):
    marker = str(tmp_path / "pwned")
    rank = tmp_path / "ck" / "iter_0000002" / "mp_rank_00"
    rank.mkdir(parents=True)
    with open(rank / "model_optim_rng.pt", "wb") as fh:
        pickle.dump({"model": {}, "x": _RunsCode(marker)}, fh, protocol=protocol)
    (tmp_path / "ck" / TRACKER).write_text("2")
    for allow in (False, True):
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(str(tmp_path / "ck"), ParallelGroups.single(), allow_unsafe=allow)
        assert "model_optim_rng.pt" in str(info.value) and "\n" not in str(info.value)
        assert "Check the documentation" not in str(info.value)
    assert not os.path.exists(marker)
    assert "UserWarning" not in capsys.readouterr().err


def test_tensor_parallel_parts_of_different_models_are_one_error(tmp_path):
    from megatron.checkpoint_merge import CheckpointShards, merge_shards

    name = "encoder.layers.0.mlp.dense_h_to_4h.weight"
    ckpt = CheckpointShards(root=str(tmp_path), iteration=1, tensor=2, pipeline=1, num_layers=1)
    with pytest.raises(CheckpointError, match="do not fit together"):
        merge_shards({(0, 0): {name: torch.zeros(4, 8)}, (1, 0): {name: torch.zeros(4, 9)}},
                     ckpt)
    with pytest.raises(CheckpointError, match="missing on tensor ranks \\[1\\]"):
        merge_shards({(0, 0): {name: torch.zeros(4, 8)}, (1, 0): {}}, ckpt)


def test_pretrained_tensor_of_another_shape_names_the_flag(tmp_path):
    from megatron.checkpoint_merge import load_into_stage

    module = torch.nn.Linear(3, 2)
    _write_checkpoint(tmp_path, dict(_good_payload(), model={"weight": torch.zeros(2, 4),
                                                             "bias": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=f"^--pretrained-checkpoint {tmp_path}: weight: "
                                              f"checkpoint gives shape \\(2, 4\\)"):
        load_into_stage(module, str(tmp_path), layer_offset=0, tp_rank=0, tp_size=1,
                        flag="--pretrained-checkpoint")


# ------------------------------------------------------------------- Hugging Face import
def _hf_dir(path, **cfg_changes):
    from safetensors.torch import save_file

    h, f, v, n = 8, 32, 10, 6
    tensors = {"wte.weight": torch.randn(v, h), "wpe.weight": torch.randn(n, h),
               "ln_f.weight": torch.ones(h), "ln_f.bias": torch.zeros(h)}
    for name, shape in (("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("ln_2.weight", (h,)),
                        ("ln_2.bias", (h,)), ("attn.c_attn.weight", (h, 3 * h)),
                        ("attn.c_attn.bias", (3 * h,)), ("attn.c_proj.weight", (h, h)),
                        ("attn.c_proj.bias", (h,)), ("mlp.c_fc.weight", (h, f)),
                        ("mlp.c_fc.bias", (f,)), ("mlp.c_proj.weight", (f, h)),
                        ("mlp.c_proj.bias", (h,))):
        tensors[f"h.0.{name}"] = torch.randn(*shape)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {"model_type": "gpt2", "n_head": 2, "n_layer": 1, "n_embd": h, "n_inner": f,
           "vocab_size": v, "n_positions": n, "activation_function": "gelu"}
    cfg.update(cfg_changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _reshape(d):
    from safetensors.torch import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t["h.0.attn.c_attn.weight"] = torch.zeros(9, 25)
    save_file(t, str(d / "model.safetensors"))


def _integer_weights(d):
    from safetensors.torch import load_file, save_file
    save_file({k: v.long() for k, v in load_file(str(d / "model.safetensors")).items()},
              str(d / "model.safetensors"))


def _sharded(weight_map):
    def change(d):
        os.rename(d / "model.safetensors", d / "part.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    return change


def _pickled(d):
    from safetensors.torch import load_file
    torch.save(load_file(str(d / "model.safetensors")), str(d / "pytorch_model.bin"))
    os.remove(d / "model.safetensors")


def _bad_tokenizer(d):
    (d / "vocab.json").write_text("{nope")
    (d / "merges.txt").write_text("#version: 0.2\n")


@pytest.mark.parametrize("change, expected", [
    (lambda d: _truncate(d / "model.safetensors"), "model.safetensors: not a readable safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b""), "not a readable safetensors"),
    (lambda d: (d / "config.json").write_text("{nope"), "config.json: expected a transformers "
                                                       "config, found a file that is not readable"),
    (lambda d: (d / "config.json").write_text("[1]"), "config.json: expected a transformers "
                                                     "config \\(a JSON object\\), found list"),
    (lambda d: (d / "config.json").write_text(DEEP_JSON), "config.json: expected a transformers"),
    (_reshape, "weight 'h.0.attn.c_attn.weight' is float32 \\(9, 25\\).* expects floating point "
               "\\(8, 24\\)"),
    (_integer_weights, "weight 'wte.weight' is int64"),
    (_sharded({"weight_map": {"a": "../../part.safetensors"}}), "shard '../../part.safetensors'"),
    (_sharded({"weight_map": {"a": "missing.safetensors"}}), "missing.safetensors: not a readable"),
    (_sharded({"no_map": 1}), "found weight_map None"),
    (_sharded([1]), "expected a safetensors index \\(a JSON object\\), found list"),
    (_pickled, "pytorch_model.bin is a pickle, .* refused; .*--allow-unsafe-checkpoint"),
    (_bad_tokenizer, "vocab.json/merges.txt do not load as a GPT-2 tokenizer"),
])
def test_hf_import_refuses_a_broken_directory_in_one_line(tmp_path, change, expected):
    from megatron.hf_import import import_hf

    hf = _hf_dir(tmp_path / "hf")
    change(hf)
    with pytest.raises(CheckpointError, match=expected):
        import_hf(str(hf), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / TRACKER)


@pytest.mark.parametrize("changes, expected", [
    ({"n_embd": 16}, "weight 'wte.weight' is float32 \\(10, 8\\).*n_embd 16"),
    ({"n_positions": 4}, "weight 'wpe.weight'"),
    ({"vocab_size": 500}, "weight 'wte.weight' is float32 \\(10, 8\\)"),
    ({"n_head": 3}, "n_embd 8 is not a multiple of n_head 3"),
    ({"n_head": "two"}, "expected n_head to be a positive integer, found 'two'"),
    ({"n_layer": None}, "expected n_layer to be a positive integer, found None"),
    ({"layer_norm_epsilon": "small"}, "expected layer_norm_epsilon to be a number"),
])
def test_hf_config_that_does_not_describe_the_weights_is_refused(tmp_path, changes, expected):
    from megatron.hf_import import import_hf

    with pytest.raises(CheckpointError, match=expected):
        import_hf(str(_hf_dir(tmp_path / "hf", **changes)), str(tmp_path / "out"))


def test_hf_pickle_loads_only_with_the_flag_and_never_runs_code(tmp_path, capsys):
    from megatron.hf_import import import_hf
    from tools.checkpoint_util import main

    hf = _hf_dir(tmp_path / "hf")
    _pickled(hf)
    with pytest.raises(SystemExit) as info:
        main(["--from-hf", str(hf), "--save", str(tmp_path / "o1")])
    assert info.value.code == 2
    assert "pytorch_model.bin" in _one_error_line(capsys.readouterr().err)
    main(["--from-hf", str(hf), "--save", str(tmp_path / "o2"), "--allow-unsafe-checkpoint"])
    assert os.path.exists(tmp_path / "o2" / TRACKER)
    marker = str(tmp_path / "pwned")
    with open(hf / "pytorch_model.bin", "wb") as fh:
        pickle.dump({"wte.weight": _RunsCode(marker)}, fh, protocol=2)
    with pytest.raises(CheckpointError, match="weights_only"):
        import_hf(str(hf), str(tmp_path / "o3"), allow_unsafe=True)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("changes, expected", [
    ({"num_layers": 3}, "has no 'encoder.layers.1.input_layernorm.weight', which its config"),
    ({"num_attention_heads": "x"}, "num_attention_heads 'x'; expected a positive integer"),
    ({"num_attention_heads": 3}, "its config does not describe its tensors"),
], ids=["layers", "heads-type", "heads"])
def test_hf_export_of_a_checkpoint_whose_config_lies_is_one_error(tmp_path, changes, expected):
    from megatron.hf_import import import_hf
    from megatron.hf_interop import export_hf

    import_hf(str(_hf_dir(tmp_path / "hf")), str(tmp_path / "ck"))
    iteration = tmp_path / "ck" / "iter_0000000"
    path = iteration / "mp_rank_00" / "model_optim_rng.json"
    doc = json.loads(path.read_text())
    doc["tree"]["config"]["model"].update(changes)
    path.write_text(json.dumps(doc))
    os.remove(iteration / "manifest.json")
    with pytest.raises(CheckpointError, match=expected):
        export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))


# --------------------------------------------------------------------- finetuning data
def _task(read):
    return SimpleNamespace(name="T", read=read)


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    (None, "cannot read it"),
    (b"", "empty file"),
    (b"a\tb\n1\t2\n", "header has no 'sentence1'/'sentence2'"),
], ids=["binary", "directory", "empty", "no-header"])
def test_mnli_file_problems_name_the_flag_and_file(tmp_path, content, expected):
    from tasks.finetune_utils import _read_all
    from tasks.glue.mnli import read_mnli_files

    path = tmp_path / "x.tsv"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    for raw, flag in ((SimpleNamespace(train_data=[str(path)], valid_data=None), "--train-data"),
                      (SimpleNamespace(train_data=None, valid_data=[str(path)]), "--valid-data")):
        with pytest.raises(DataError, match=f"^{flag}: {path}(:1)?: {expected}"):
            _read_all(_task(read_mnli_files), raw)


def test_race_passages_that_are_binary_or_too_deep_are_skipped_as_malformed(tmp_path, capsys):
    from tasks.finetune_utils import _read_all
    from tasks.race.data import read_race

    (tmp_path / "1.txt").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "2.txt").write_text(DEEP_JSON)
    examples, report = read_race([str(tmp_path)])
    assert examples == [] and len(report.malformed) == 2
    assert "not UTF-8 text" in report.malformed[0]
    assert "nested too deeply" in report.malformed[1]
    with pytest.raises(SystemExit) as info:
        _read_all(_task(read_race), SimpleNamespace(train_data=None, valid_data=[str(tmp_path)]))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --valid-data {tmp_path}: no usable T examples (first "
                          f"problem: {tmp_path / '1.txt'}:1: not UTF-8 text")
    with pytest.raises(DataError, match="--train-data: RACE data path .*nope does not exist"):
        _read_all(_task(read_race), SimpleNamespace(train_data=[str(tmp_path / "nope")],
                                                    valid_data=None))


def test_wikitext_file_problems_name_valid_data(tmp_path):
    from tasks.zeroshot_gpt.datasets import read_wikitext

    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    for path, expected in ((tmp_path / "bin.txt", "not UTF-8 text"),
                           (tmp_path / "none.txt", "cannot read it"), (tmp_path, "cannot read it")):
        with pytest.raises(DataError, match=f"^--valid-data {path}: {expected}.*WikiText"):
            read_wikitext([str(path)])


# ------------------------------------------------------------------------------- tools
@pytest.mark.parametrize("content, expected", [
    (b'\xff\xfe{"text": "a"}\n', "not UTF-8 text"),
    (DEEP_JSON.encode() + b"\n", "line 1: not valid JSON \\(nested too deeply\\)"),
], ids=["binary", "deep"])
def test_preprocess_input_that_is_binary_or_too_deep_is_one_line(tmp_path, capsys, content,
                                                                 expected):
    import re

    from tools.preprocess_data import main

    (tmp_path / "in.jsonl").write_bytes(content)
    with pytest.raises(SystemExit) as info:
        main(["--input", str(tmp_path / "in.jsonl"), "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "100", "--output-prefix", str(tmp_path / "out")])
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert re.search(f"--input {tmp_path / 'in.jsonl'}.*{expected}", line), line
    assert not list(tmp_path.glob("out*"))


def test_train_tokenizer_command_line_reports_input_problems(tmp_path):
    pytest.importorskip("sentencepiece")
    from tools.train_tokenizer import _command_line

    (tmp_path / "bin.jsonl").write_bytes(b'\xff\xfe{"text": "a"}\n')
    (tmp_path / "num.jsonl").write_text("5\n")
    (tmp_path / "tiny.txt").write_text("hello world\n")
    for name, extra, expected in (
            ("bin.jsonl", [], "bin.jsonl'?: not UTF-8 text"),
            ("num.jsonl", ["--input-format", "json"], "line 1: expected a JSON object, found int"),
            ("tiny.txt", [], "SentencePiece could not train on --input .*tiny.txt: Vocabulary "
                             "size too high"),
            ("missing.txt", [], "--input: no such file")):
        with pytest.raises(UserError, match=expected):
            _command_line(["--input", str(tmp_path / name), "--vocab-size", "400",
                           "--output-prefix", str(tmp_path / "t")] + extra)


def test_trace_and_profile_files_of_the_wrong_shape_are_value_errors(tmp_path):
    from megatron.pipeline.planner.profile import Profile
    from megatron.pipeline.trace import load_trace

    cases = {"deep.json": (DEEP_JSON, "JSON nested too deeply"),
             "ev.json": ('{"events": [1]}', "event 1 is not an object"),
             "ev2.json": ('{"events": [{"start": "a", "end": 1}]}', "event .* numeric 'start'"),
             "list.json": ("[1]", "no 'events' list")}
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{name} is not a trace file \\({expected}"):
            load_trace(str(tmp_path / name))
    for name, expected in (("list.json", "expected a JSON object .* found list"),
                           ("deep.json", "not JSON")):
        with pytest.raises(ValueError, match=f"--profile .*{name}: {expected}"):
            Profile.load(str(tmp_path / name))


def test_megatron_lm_release_tracker_is_named_not_read_as_iteration_0(tmp_path):
    """Megatron-LM's released weights (tracker 'release', pickles under release/) are
    refused with what to do instead, not reported as a missing iter_0000000."""
    (tmp_path / TRACKER).write_text("release\n")
    (tmp_path / "release").mkdir()
    with pytest.raises(CheckpointError, match="Megatron-LM 'release' checkpoint.*--from-hf"):
        read_tracker(str(tmp_path))


def test_load_errors_every_rank_shares_print_once_per_node(monkeypatch):
    """load_for_run gathers every rank's finding: one text on all ranks (another shape or
    layout, found alike) is marked for one line per node; different texts (each rank's
    own damaged file) still print on each rank."""
    import megatron.checkpoint_load as ckpt

    def boom(root):
        raise CheckpointError("--load ck: the checkpoint is of another model shape")
    monkeypatch.setattr(ckpt, "find_checkpoint", boom)
    for gathered, alike in ((["same", "same"], True), (["same", None], True),
                            (["mine", "yours"], False)):
        monkeypatch.setattr(ckpt, "gather", lambda error, g=gathered: list(g))
        with pytest.raises(CheckpointError) as info:
            ckpt.load_for_run("ck", None, None)
        assert info.value.every_rank_alike is alike, gathered

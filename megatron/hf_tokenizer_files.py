"""The tokenizer side of a transformers export: the tokenizer files written next to the
model (``tokenizer_files``) and a GPT's config.json bos/eos ids (``special_token_ids``),
both from the tokenizer the checkpoint records.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple


_GPT2_EOT, _GPT2_EOT_ID = "<|endoftext|>", 50256


def special_token_ids(data_cfg: Dict[str, Any], vocab: int) -> Dict[str, Optional[int]]:
    """bos/eos ids for a GPT's config.json from the tokenizer the checkpoint records:
    GPT2BPETokenizer's <|endoftext|> id in its vocab.json (the trainer's end of document;
    GPT-2's 50256 only when that file is not on this machine), a HuggingFaceTokenizer's
    own special tokens; {} (null ids) otherwise.  An id outside the exported ``vocab``
    rows is null too (transformers warns about it and generation could never emit it)."""
    kind = data_cfg.get("tokenizer_type")
    ids: Dict[str, Optional[int]] = {}
    if kind == "GPT2BPETokenizer":
        try:
            with open(str(data_cfg.get("vocab_file")), encoding="utf-8") as fh:
                eot = json.load(fh).get(_GPT2_EOT)
        except (OSError, ValueError, AttributeError):  # not here, or not a vocab.json
            eot = _GPT2_EOT_ID
        ids = {"bos_token_id": eot, "eos_token_id": eot}
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        try:
            hf = HuggingFaceTokenizer(data_cfg.get("tokenizer_model")).hf
        except (ValueError, TypeError):  # not on this machine: tokenizer_files says so
            return {}
        ids = {"bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id}
    return {k: (v if type(v) is int and 0 <= v < vocab else None) for k, v in ids.items()}


def tokenizer_files(data_cfg: Dict[str, Any], out_dir: str, n_positions: int) -> str:
    """Copy the tokenizer's vocabulary files; returns a one-line note of what was done."""
    kind = data_cfg.get("tokenizer_type")
    files: List[Tuple[Optional[str], str]] = []
    tok_cfg: Dict[str, Any] = {"model_max_length": n_positions}
    if kind == "GPT2BPETokenizer":
        files = [(data_cfg.get("vocab_file"), "vocab.json"),
                 (data_cfg.get("merge_file"), "merges.txt")]
        tok_cfg.update(tokenizer_class="GPT2Tokenizer", bos_token="<|endoftext|>",
                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    elif kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        files = [(data_cfg.get("vocab_file"), "vocab.txt")]
        tok_cfg.update(tokenizer_class="BertTokenizer",
                       do_lower_case=kind == "BertWordPieceLowerCase")
    elif kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        spec = data_cfg.get("tokenizer_model")
        try:
            tokenizer = HuggingFaceTokenizer(spec)
        except ValueError as exc:
            return f"no tokenizer files written: {exc}"
        tokenizer.hf.model_max_length = n_positions
        written = tokenizer.hf.save_pretrained(out_dir)
        return (f"tokenizer files ({kind} {spec}): "
                f"{', '.join(sorted(os.path.basename(str(w)) for w in written))}")
    else:
        return (f"no tokenizer files written: the model was trained with {kind}, which has "
                f"no transformers tokenizer equivalent")
    missing = [src for src, _ in files if not src or not os.path.isfile(src)]
    if missing:
        return (f"no tokenizer files written: {kind} files {missing} recorded in the "
                f"checkpoint are not on this machine")
    for src, name in files:
        shutil.copyfile(src, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(tok_cfg, fh, indent=2)
    return f"tokenizer files ({kind}): {', '.join(n for _, n in files)}"

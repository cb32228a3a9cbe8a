"""Sample text from a GPT checkpoint: the training tokenizer for text, transformers for
the model.

The checkpoint (any tensor/pipeline layout) is merged and exported exactly as
``tools/checkpoint_util.py --to-hf`` exports it, into a temporary directory, and loaded
as the transformers model that computes what ours computes (GPT-2, Llama, Qwen2/3; the
export refuses, naming the flags, a model none of them matches).  Its ``generate`` does
the decoding: a KV cache, temperature, top-k and top-p.  Text goes through the tokenizer
the checkpoint was trained with (its ``--tokenizer-type`` and the files it recorded, or
files given again), so SentencePiece, null and character tokenizers work too, which have
no transformers equivalent.  ``tools/generate_samples_gpt.py`` is the command line.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron.errors import CheckpointError, UserError

TOKENIZER_FILE_FLAGS = (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file"),
                        ("tokenizer_model", "--tokenizer-model"))
"""The tokenizer files a checkpoint records, with the flag that gives each again."""

FILES_READ = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
              "SentencePieceTokenizer": ("tokenizer_model",),
              "GPTSentencePieceTokenizer": ("tokenizer_model",),
              "BertWordPieceLowerCase": ("vocab_file",), "BertWordPieceCase": ("vocab_file",),
              "HuggingFaceTokenizer": ("tokenizer_model",),
              "NullTokenizer": (), "CharTokenizer": ()}
"""The files each tokenizer type reads (``megatron.tokenizer.build_tokenizer``)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn (the flags of ``tools/generate_samples_gpt.py``)."""

    tokens_to_generate: int = 64
    """At most this many new tokens per sample (fewer at the end-of-document token, or
    where the model's position limit comes first)."""
    greedy: bool = False
    """Always take the most likely token (temperature, top-k and top-p are then unused)."""
    temperature: float = 1.0
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 = all."""
    top_p: float = 0.0
    """Sample among the most likely tokens whose probabilities sum to p; 0 = all."""
    seed: int = 1234


def check_sampling(params: SamplingParams) -> None:
    """One error naming the flag for a value that cannot be sampled with."""
    if params.tokens_to_generate < 1:
        raise UserError(f"--tokens-to-generate {params.tokens_to_generate}: expected a "
                        f"positive number of tokens")
    if not (math.isfinite(params.temperature) and params.temperature > 0):
        raise UserError(f"--temperature {params.temperature:g}: expected a positive number "
                        f"(use --greedy for the most likely token)")
    if params.top_k < 0:
        raise UserError(f"--top-k {params.top_k}: expected 0 (off) or a positive number of "
                        f"tokens")
    if not (0.0 <= params.top_p <= 1.0):
        raise UserError(f"--top-p {params.top_p:g}: expected a probability in [0, 1] "
                        f"(0 = off)")
    if params.top_k and params.top_p:
        raise UserError(f"--top-k {params.top_k} and --top-p {params.top_p:g}: give one of "
                        f"them (as Megatron-LM's generation)")


def build_checkpoint_tokenizer(data_cfg: Dict[str, Any], overrides: Dict[str, Optional[str]]):
    """The tokenizer a checkpoint was trained with, from the data config it recorded.

    ``overrides`` maps ``vocab_file``/``merge_file``/``tokenizer_model`` to a path given
    again on the command line (the recorded one may be on another machine, or relative
    to another directory)."""
    from megatron.config import DataConfig
    from megatron.tokenizer import build_tokenizer

    kind = data_cfg.get("tokenizer_type")
    if not kind:
        raise CheckpointError("--load: the checkpoint records no --tokenizer-type; expected "
                              "a checkpoint written by this trainer's pretrain_gpt.py")
    reads = FILES_READ.get(kind)
    for key, flag in TOKENIZER_FILE_FLAGS:
        if reads is not None and overrides.get(key) and key not in reads:
            takes = " and ".join(f for k, f in TOKENIZER_FILE_FLAGS if k in reads)
            raise UserError(f"{flag} {overrides[key]}: the checkpoint's tokenizer is {kind}, "
                            f"which reads {takes or 'no tokenizer file'}; leave {flag} out")
    vocab = data_cfg.get("vocab_size")
    if kind == "NullTokenizer" and vocab and not data_cfg.get("tokenizer_vocab_size"):
        vocab = int(vocab) - 1  # saved when --vocab-size N meant N ids, eod N - 1
    fields = {"tokenizer_type": kind,
              "vocab_size": vocab,
              "make_vocab_size_divisible_by": int(
                  data_cfg.get("make_vocab_size_divisible_by") or 128)}
    for key, flag in TOKENIZER_FILE_FLAGS:
        fields[key] = overrides.get(key) or data_cfg.get(key)
    try:
        return build_tokenizer(DataConfig(**fields), vocab_size=fields["vocab_size"])
    except (ValueError, OSError) as exc:
        missing = [(key, flag) for key, flag in TOKENIZER_FILE_FLAGS
                   if data_cfg.get(key) and not overrides.get(key)]
        recorded = ", ".join(f"{flag} {data_cfg[key]!r}" for key, flag in missing)
        if any(not os.path.isabs(str(data_cfg[key])) for key, _ in missing):
            recorded += ", relative to the directory training ran in"
        again = ("the files again with those flags" if len(missing) > 1 else
                 "the file again with that flag")
        where = f" (the checkpoint recorded {recorded}; give {again})" if missing else ""
        raise UserError(f"{kind}: {exc}{where}") from None


def recorded_config(load: str, iteration: Optional[int], allow_unsafe: bool = False
                    ) -> Dict[str, Any]:
    """The config a checkpoint recorded, from its first rank's JSON file alone
    (``checkpointing.recorded_config_at``; the export reads the tensors later).  Where
    that cannot be read (no tracker, an old pickle checkpoint, a damaged layout) the full
    reader gives its error, or reads it."""
    from megatron.checkpoint_merge import read_checkpoint
    from megatron.checkpoint_discovery import recorded_config_at
    from megatron.checkpoint_files import iteration_dir, read_tracker

    try:
        it = iteration if iteration is not None else read_tracker(load)
        if it is not None:
            return recorded_config_at(iteration_dir(load, it))
    except (OSError, UserError):
        pass
    return read_checkpoint(load, iteration, allow_unsafe=allow_unsafe,
                           flag="--load").config or {}


def _pick_dtype(name: str, stored: torch.dtype, device: torch.device) -> torch.dtype:
    if name == "auto":  # half precision is slow or unsupported for matmuls on a CPU
        return torch.float32 if device.type == "cpu" else stored
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


class Generator:
    """A checkpoint loaded for sampling: ``generate(prompt)`` -> a dict per sample."""

    def __init__(self, load: str, *, iteration: Optional[int] = None,
                 device: str = "auto", dtype: str = "auto",
                 tokenizer_files: Optional[Dict[str, Optional[str]]] = None,
                 allow_unsafe: bool = False) -> None:
        import transformers

        from megatron.hf_interop import export_hf

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: no CUDA device is visible; expected a GPU (or "
                            "--device cpu)")
        self.device = torch.device(device)
        config = recorded_config(load, iteration, allow_unsafe)
        model_cfg = config.get("model") or {}
        if model_cfg.get("num_tokentypes"):
            raise UserError(f"--load {load}: a BERT checkpoint (token types); sampling "
                            f"needs a GPT trained with pretrain_gpt.py")
        self.tokenizer = build_checkpoint_tokenizer(config.get("data") or {},
                                                    tokenizer_files or {})
        with tempfile.TemporaryDirectory(prefix="generate_samples_") as tmp:
            out = os.path.join(tmp, "hf")
            notes = io.StringIO()  # about the files of a temporary export: not for the user
            try:
                with contextlib.redirect_stderr(notes):
                    export_hf(load, out, iteration=iteration,
                              true_vocab=self.tokenizer.vocab_size, allow_unsafe=allow_unsafe)
            except UserError as exc:  # "--to-hf: ...": a flag this tool does not have
                message = str(exc)
                if not message.startswith("--to-hf"):
                    raise
                raise type(exc)(f"--load {load}: cannot export it for transformers' "
                                f"generate: {message[len('--to-hf'):].lstrip(': ')}") from None
            with open(os.path.join(out, "config.json")) as fh:
                kind = json.load(fh).get("model_type")
            if kind not in ("gpt2", "llama", "qwen2", "qwen3"):
                raise UserError(f"--load {load}: exports as a transformers {kind} model; "
                                f"sampling needs a GPT trained with pretrain_gpt.py")
            model = transformers.AutoModelForCausalLM.from_pretrained(out)
        stored = next(model.parameters()).dtype
        self.dtype = _pick_dtype(dtype, stored, self.device)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        config = self.model.config
        self.max_positions = int(getattr(config, "n_positions", None)
                                 or config.max_position_embeddings)
        self.vocab = int(config.vocab_size)
        if self.tokenizer.vocab_size > self.vocab:  # the export kept every row it had
            given = [f"{flag} {(tokenizer_files or {})[key]}"
                     for key, flag in TOKENIZER_FILE_FLAGS if (tokenizer_files or {}).get(key)]
            raise UserError(f"{', '.join(given) or '--load ' + load}: "
                            f"{self.tokenizer.name} has {self.tokenizer.vocab_size} tokens, "
                            f"more than the {self.vocab} rows of the checkpoint's word "
                            f"embedding; expected the tokenizer it was trained with")

    def _eod(self) -> Optional[int]:
        try:
            eod = int(self.tokenizer.eod)
        except (ValueError, NotImplementedError, AttributeError):
            return None
        return eod if 0 <= eod < self.vocab else None

    def encode(self, prompt: str, source: str = "--prompt") -> List[int]:
        """Token ids of ``prompt``; the empty prompt starts from the end-of-document token
        (an unconditional sample, as Megatron-LM draws one).  ``source`` names the prompt
        in an error (the flag, or the file and line)."""
        if prompt == "":
            eod = self._eod()
            if eod is None:
                raise UserError(f"{source} '': an unconditional sample starts from the "
                                f"end-of-document token, which {self.tokenizer.name} lacks; "
                                f"give a prompt")
            return [eod]
        try:
            ids = list(self.tokenizer.tokenize(prompt))
        except ValueError as exc:  # also GPT-2 BPE files of two tokenizers
            raise UserError(f"{source} {prompt[:40]!r}: {exc}") from None
        if not ids:
            raise UserError(f"{source} {prompt[:40]!r}: the tokenizer gives no tokens for it")
        if len(ids) >= self.max_positions:
            raise UserError(f"{source} {prompt[:40]!r}: {len(ids)} tokens; the model takes "
                            f"{self.max_positions} positions, so a prompt may have at most "
                            f"{self.max_positions - 1}")
        return ids

    def generate_ids(self, ids: Sequence[int], params: SamplingParams) -> List[int]:
        """New token ids after ``ids`` (the end-of-document token, if drawn, included)."""
        room = min(params.tokens_to_generate, self.max_positions - len(ids))
        eod = self._eod()
        kwargs: Dict[str, Any] = dict(max_new_tokens=room, do_sample=not params.greedy,
                                      pad_token_id=eod if eod is not None else 0,
                                      eos_token_id=eod)
        if not params.greedy:  # given explicitly: transformers' defaults add top-k 50
            kwargs.update(temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p or 1.0)
        size = self.tokenizer.vocab_size
        if size < self.vocab:  # rows of vocabulary padding: never a token
            kwargs["suppress_tokens"] = list(range(size, self.vocab))
        prompt = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      **kwargs)
        return out[0, len(ids):].tolist()

    def generate(self, prompt: str, params: SamplingParams) -> Dict[str, Any]:
        """One sample: ``{"prompt", "text", "tokens", "finished"}``; ``finished`` is True
        when the end-of-document token ended it (it is not part of ``text``)."""
        return self.sample(prompt, self.encode(prompt), params)

    def sample(self, prompt: str, ids: Sequence[int], params: SamplingParams
               ) -> Dict[str, Any]:
        """``generate`` for a prompt already encoded as ``ids``."""
        new = self.generate_ids(ids, params)
        eod = self._eod()
        finished = bool(new) and eod is not None and new[-1] == eod
        kept = new[:-1] if finished else new
        text = self.tokenizer.detokenize(kept)
        if prompt:  # decoded after the prompt: SentencePiece puts a word's space on the word
            head = self.tokenizer.detokenize(ids)
            whole = self.tokenizer.detokenize(list(ids) + kept)
            text = whole[len(head):] if whole.startswith(head) else text
        return {"prompt": prompt, "text": text, "tokens": len(new), "finished": finished}


def generate_samples(generator: Generator, prompts: Sequence[str], num_samples: int,
                     params: SamplingParams, sources: Optional[Sequence[str]] = None
                     ) -> List[Dict[str, Any]]:
    """``num_samples`` samples of each prompt, in order, from one seeded stream.  Every
    prompt is encoded (and a bad one refused, named by ``sources``) before the first
    sample."""
    sources = list(sources) if sources is not None else ["--prompt"] * len(prompts)
    encoded = [generator.encode(p, source) for p, source in zip(prompts, sources)]
    torch.manual_seed(params.seed)
    return [generator.sample(p, ids, params) for p, ids in zip(prompts, encoded)
            for _ in range(num_samples)]


def write_jsonl(path: str, samples: Sequence[Dict[str, Any]]) -> None:
    """Write ``samples`` one JSON object per line; the file appears whole or not at all."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            for sample in samples:
                fh.write(json.dumps(sample, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"--sample-output-file {path}: cannot write it "
                        f"({exc.strerror or type(exc).__name__})") from None


def print_samples(samples: Sequence[Dict[str, Any]], stream=None) -> None:
    """Human-readable samples: the prompt, then the continuation."""
    stream = stream or sys.stdout
    for i, sample in enumerate(samples):
        end = "end of document" if sample["finished"] else "length limit"
        print(f"=== sample {i} ({sample['tokens']} tokens, stopped at {end})", file=stream)
        if sample["prompt"]:
            print(f"[prompt] {sample['prompt']}", file=stream)
        print(sample["text"], file=stream, flush=True)

"""Tokenize a JSON-lines corpus into ``.bin``/``.idx`` datasets for pretraining.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8 --output-prefix my-gpt2

writes ``my-gpt2_text_document.bin`` and ``.idx`` (one per ``--json-keys`` entry), the
files ``--data-path my-gpt2_text_document`` reads.  Each input line is one JSON object
holding one document; worker processes tokenize chunks of lines while the main process
writes them in input order, so the output does not depend on ``--workers``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

# Allow running from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.config import DataConfig  # noqa: E402
from megatron.data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402

# Per-worker state, set by _init_worker in each pool process.
_tokenizer = None
_args: Optional[argparse.Namespace] = None
_dtype = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON object (one output dataset each)")
    g.add_argument("--split-sentences", action="store_true",
                   help="split documents into sentences (one sequence per sentence, as BERT "
                        "pretraining needs); a rule-based splitter, no downloaded models")
    g.add_argument("--keep-newlines", action="store_true",
                   help="with --split-sentences, keep newlines between sentences")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True,
                   help="GPT2BPETokenizer, SentencePieceTokenizer, BertWordPieceLowerCase, "
                        "BertWordPieceCase, NullTokenizer, CharTokenizer, ...")
    g.add_argument("--vocab-file", default=None, help="vocabulary (BPE / WordPiece)")
    g.add_argument("--merge-file", default=None, help="BPE merge file")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece model")
    g.add_argument("--vocab-size", type=int, default=None, help="vocab size (NullTokenizer)")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                   help="accepted for compatibility; only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunk-size", type=int, default=64,
                   help="lines handed to a worker at a time")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print progress every this many documents")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: file not found")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    return args


def _make_tokenizer(args: argparse.Namespace):
    cfg = DataConfig(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                     merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    return build_tokenizer(cfg, vocab_size=args.vocab_size)


def _init_worker(args: argparse.Namespace) -> None:
    global _tokenizer, _args, _dtype
    _args = args
    _tokenizer = _make_tokenizer(args)
    _dtype = best_fitting_dtype(_tokenizer.vocab_size)


def _encode(item: Tuple[int, str]) -> Tuple[int, Dict[str, np.ndarray], int]:
    """(line number, line) -> (line number, {key: token array}, bytes of input)."""
    lineno, line = item
    nbytes = len(line.encode("utf-8"))
    if not line.strip():
        return lineno, {}, nbytes
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--input {_args.input}, line {lineno}: not valid JSON ({exc})") from None
    out = {}
    for key in _args.json_keys:
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"--input {_args.input}, line {lineno}: no key {key!r} "
                             f"(requested by --json-keys)")
        text = obj[key]
        if not isinstance(text, str):
            raise ValueError(f"--input {_args.input}, line {lineno}: {key!r} must be a string, "
                             f"got {type(text).__name__}")
        if _args.split_sentences:
            out[key] = _encode_sentences(text)
            continue
        ids = _tokenizer.tokenize(text)
        if ids and _args.append_eod:
            ids.append(_tokenizer.eod)
        out[key] = np.asarray(ids, dtype=_dtype)
    return lineno, out, nbytes


def _encode_sentences(text: str) -> List[np.ndarray]:
    """One token array per non-empty sentence; --append-eod goes after the last one."""
    from megatron.data.sentence_split import split_sentences

    pieces = [_tokenizer.tokenize(s) for s in split_sentences(text, _args.keep_newlines)]
    pieces = [p for p in pieces if p]
    if pieces and _args.append_eod:
        pieces[-1].append(_tokenizer.eod)
    return [np.asarray(p, dtype=_dtype) for p in pieces]


def output_prefix(args: argparse.Namespace, key: str) -> str:
    return f"{args.output_prefix}_{key}_document"


def _progress(n_docs: int, n_tokens: int, n_bytes: int, elapsed: float) -> str:
    elapsed = max(elapsed, 1e-9)
    return (f"{n_docs / elapsed:.1f} docs/s, {n_tokens / elapsed:.0f} tokens/s, "
            f"{n_bytes / elapsed / 1e6:.2f} MB/s")


def preprocess(args: argparse.Namespace) -> Dict[str, float]:
    """Run the whole conversion; returns counts and rates (also printed)."""
    _init_worker(args)  # the main process needs the dtype and validates the tokenizer
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {k: IndexedDatasetBuilder(output_prefix(args, k) + ".bin", _dtype)
                for k in args.json_keys}
    n_docs = n_tokens = n_bytes = n_empty = 0
    start = time.perf_counter()
    pool = None
    try:
        with open(args.input, "r", encoding="utf-8") as fin:
            lines = enumerate(fin, start=1)
            if args.workers > 1:
                pool = multiprocessing.Pool(args.workers, initializer=_init_worker,
                                            initargs=(args,))
                results = pool.imap(_encode, lines, chunksize=args.chunk_size)
            else:
                results = map(_encode, lines)
            for _, docs, nbytes in results:
                n_bytes += nbytes
                if not docs:
                    continue
                n_docs += 1
                for key, ids in docs.items():
                    # Sentence-split documents arrive as a list of sentences.
                    sequences = ids if isinstance(ids, list) else [ids]
                    # An empty document would only add a zero-length sequence.
                    if sum(int(x.size) for x in sequences) == 0:
                        n_empty += 1
                        continue
                    for seq in sequences:
                        builders[key].add_item(seq)
                        n_tokens += int(seq.size)
                    builders[key].end_document()
                if n_docs % args.log_interval == 0:
                    print(f"Processed {n_docs} documents ("
                          f"{_progress(n_docs, n_tokens, n_bytes, time.perf_counter() - start)})",
                          file=sys.stderr, flush=True)
        for key, builder in builders.items():
            builder.finalize(output_prefix(args, key) + ".idx")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    elapsed = time.perf_counter() - start
    print(f"Done: {n_docs} documents, {n_tokens} tokens, {n_bytes} bytes in {elapsed:.3f} s "
          f"({_progress(n_docs, n_tokens, n_bytes, elapsed)}); skipped {n_empty} empty.",
          flush=True)
    for key in args.json_keys:
        print(f"Wrote {output_prefix(args, key)}.bin/.idx", flush=True)
    return {"documents": n_docs, "tokens": n_tokens, "bytes": n_bytes, "seconds": elapsed,
            "docs_per_s": n_docs / max(elapsed, 1e-9),
            "tokens_per_s": n_tokens / max(elapsed, 1e-9),
            "mb_per_s": n_bytes / max(elapsed, 1e-9) / 1e6}


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    args = parse_args(argv)
    try:
        return preprocess(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"preprocess_data.py: error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

"""Tokenize a JSON-lines corpus into ``.bin``/``.idx`` datasets for pretraining.

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8 --output-prefix my-gpt2

writes ``my-gpt2_text_document.bin`` and ``.idx`` (one per ``--json-keys`` entry), the
files ``--data-path my-gpt2_text_document`` reads; with ``--split-sentences`` (BERT) the
name ends in ``_sentence`` instead, as Megatron's: ``my-bert_text_sentence``.  Each input line is one JSON object
holding one document; worker processes tokenize chunks of lines while the main process
writes them in input order, so the output does not depend on ``--workers``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from itertools import chain, islice
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

# Allow running from a source checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.data.indexed_dataset import IndexedDatasetBuilder, best_fitting_dtype  # noqa: E402
from megatron.entry import exit_with_user_error  # noqa: E402
from megatron.errors import DataError, UserError  # noqa: E402
from megatron.arguments import OneLineParser  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402

# Per-worker state, set by _init_worker in each pool process.
_tokenizer = None
_args: Optional[argparse.Namespace] = None
_dtype = None

# One chunk's output for one --json-keys entry: all token ids back to back, the length
# of each sequence, and how many sequences each document has.
Encoded = Tuple[np.ndarray, List[int], List[int]]

# Half of a UTF-16 pair: json.loads accepts one escaped alone ("\ud800"), but it is not
# Unicode text and no tokenizer can encode it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
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
                        "BertWordPieceCase, HuggingFaceTokenizer, NullTokenizer, CharTokenizer, ...")
    # --vocab: Megatron-LM's 2020-21 README and scripts wrote it, which its parser took
    # as --vocab-file; here it would be an ambiguous prefix (--vocab-file, --vocab-size)
    g.add_argument("--vocab-file", "--vocab", default=None,
                   help="vocabulary (BPE / WordPiece)")
    g.add_argument("--merge-file", default=None, help="BPE merge file")
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model; HuggingFaceTokenizer: a tokenizer directory "
                        "(save_pretrained's) or a model name")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: data ids 0..N-1; end of document N")
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True,
                   help="writes {prefix}_{key}_document.bin/.idx ({prefix}_{key}_sentence "
                        "with --split-sentences)")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"],
                   help="accepted for compatibility; only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunk-size", type=int, default=256,
                   help="lines handed to a worker at a time (and encoded in one batch)")
    g.add_argument("--no-fast-tokenizer", action="store_true",
                   help="use the pure-Python GPT-2 BPE / WordPiece even when the "
                        "'tokenizers' package is installed (ids are identical either way)")
    g.add_argument("--log-interval", type=int, default=1000,
                   help="print progress every this many documents")
    g = p.add_argument_group("Megatron-LM flags accepted so its commands run unchanged")
    g.add_argument("--partitions", type=int, default=1,
                   help="Megatron-LM deals the input lines round-robin into this many "
                        "partitions (line i to partition i %% N) and concatenates their "
                        "outputs; the documents here come in that order too (one pass, "
                        "--workers parallelises it)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="with --partitions: contiguous partitions, so the documents keep "
                        "the input order (as without --partitions)")
    g.add_argument("--lang", default="english",
                   help="Megatron-LM's NLTK punkt language for --split-sentences; the "
                        "splitter here is rule-based English")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.chunk_size < 1:
        parser.error(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.log_interval < 1:
        parser.error(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.partitions < 1:
        parser.error(f"--partitions must be >= 1, got {args.partitions}")
    if args.partitions > 1:
        order = ("input order (--keep-sequential-samples)" if args.keep_sequential_samples
                 else f"Megatron-LM's merged order: lines 1, {args.partitions + 1}, ... then "
                      f"2, {args.partitions + 2}, ...")
        print(f"note: --partitions {args.partitions}: one pass over --input with --workers "
              f"{args.workers}; documents in {order}, the files Megatron-LM's partitions "
              f"merge into", file=sys.stderr)
    if args.split_sentences and args.lang.lower() != "english":
        print(f"note: --lang {args.lang}: the sentence splitter here is rule-based English "
              f"(Megatron-LM uses NLTK's punkt model for the language); sentences of other "
              f"languages may be cut differently", file=sys.stderr)
    return args


def _make_tokenizer(args: argparse.Namespace):
    # The DataConfig fields build_tokenizer reads; megatron.config itself would import
    # torch, seconds of start-up this tool does not need.
    cfg = SimpleNamespace(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                          merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                          make_vocab_size_divisible_by=128)
    return build_tokenizer(cfg, vocab_size=args.vocab_size,
                           fast=False if args.no_fast_tokenizer else None)


def _init_worker(args: argparse.Namespace) -> None:
    global _tokenizer, _args, _dtype
    _args = args
    _tokenizer = _make_tokenizer(args)
    _dtype = best_fitting_dtype(_tokenizer.vocab_size)


def _document_texts(lineno: int, raw: bytes) -> Optional[Dict[str, str]]:
    """{key: text} of one input line (bytes, decoded here so that an error can name the
    line); None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"--input {_args.input}, line {lineno}: not UTF-8 text ({exc.reason}, "
                        f"byte {raw[exc.start:exc.start + 1]!r} at byte {exc.start} of the "
                        f"line); expected a JSON-lines corpus in UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"--input {_args.input}, line {lineno}: not valid JSON ({exc})") from None
    except RecursionError:
        raise DataError(f"--input {_args.input}, line {lineno}: not valid JSON (nested too "
                        f"deeply); expected one JSON object per line") from None
    if not isinstance(obj, dict):
        raise DataError(f"--input {_args.input}, line {lineno}: expected a JSON object "
                        f"(holding --json-keys {' '.join(_args.json_keys)}), found "
                        f"{type(obj).__name__}")
    out = {}
    for key in _args.json_keys:
        if key not in obj:
            raise DataError(f"--input {_args.input}, line {lineno}: no key {key!r} "
                            f"(requested by --json-keys)")
        text = obj[key]
        # A list of strings is a document already cut into sentences (the form of
        # Megatron-LM's --split-sentences intermediate *_ss.json): one sequence per
        # non-empty string, as Megatron-LM's Encoder.encode.
        parts = text if isinstance(text, list) else [text]
        for part in parts:
            if not isinstance(part, str):
                what = f"a list holding {type(part).__name__}" if parts is text else \
                    type(part).__name__
                raise DataError(f"--input {_args.input}, line {lineno}: {key!r} must be a "
                                f"string or a list of strings (sentences), found {what}")
            bad = _SURROGATE.search(part)
            if bad:
                raise DataError(f"--input {_args.input}, line {lineno}: {key!r} holds a lone "
                                f"UTF-16 surrogate {bad.group()!r} (escaped in the JSON), "
                                f"which is not Unicode text; remove or replace it")
        out[key] = text
    return out


def _encode_chunk(chunk: List[Tuple[int, bytes]]) -> Tuple[int, int, Dict[str, Encoded]]:
    """Lines -> (documents, input bytes, {key: Encoded}).

    All texts of a chunk go to the tokenizer in one ``tokenize_batch`` call (the fast
    backend's batch API); the ids come back as one flat array per key, so the parent
    process handles a few numpy arrays per chunk rather than a list per document.
    """
    nbytes = sum(len(line) for _, line in chunk)
    docs = [d for d in (_document_texts(n, line) for n, line in chunk) if d is not None]
    out: Dict[str, Encoded] = {}
    for key in _args.json_keys:
        # Each document's sentences: its text whole, or the strings of a list value;
        # --split-sentences cuts each further.  Sentences without tokens are dropped.
        per_doc = [d[key] if isinstance(d[key], list) else [d[key]] for d in docs]
        if _args.split_sentences:
            from megatron.data.sentence_split import split_sentences

            per_doc = [[s for part in parts for s in split_sentences(part, _args.keep_newlines)]
                       for parts in per_doc]
        flat = _tokenizer.tokenize_batch([s for sents in per_doc for s in sents])
        pieces, pos = [], 0
        for sents in per_doc:
            pieces.append([list(ids) for ids in flat[pos:pos + len(sents)] if len(ids)])
            pos += len(sents)
        seq_lengths: List[int] = []
        seqs_per_doc: List[int] = []
        for doc in pieces:
            if doc and _args.append_eod:
                doc[-1].append(_tokenizer.eod)  # after the document's last sentence
            seq_lengths.extend(len(ids) for ids in doc)
            seqs_per_doc.append(len(doc))
        tokens = np.fromiter(chain.from_iterable(ids for doc in pieces for ids in doc),
                             dtype=_dtype, count=sum(seq_lengths))
        out[key] = (tokens, seq_lengths, seqs_per_doc)
    return len(docs), nbytes, out


def _chunks(lines: Iterator[Tuple[int, bytes]], size: int
            ) -> Iterator[List[Tuple[int, bytes]]]:
    while True:
        chunk = list(islice(lines, size))
        if not chunk:
            return
        yield chunk


def _route(encoded: Encoded, first_doc: int, n: int) -> List[Tuple[int, Encoded]]:
    """Split one chunk's documents by partition (document k goes to partition k % n),
    as Megatron-LM deals input lines round-robin into its --partitions files."""
    tokens, seq_lengths, seqs_per_doc = encoded
    seq_start = np.concatenate([[0], np.cumsum(seqs_per_doc, dtype=np.int64)])
    tok_start = np.concatenate([[0], np.cumsum(seq_lengths, dtype=np.int64)])
    out = []
    for p in range(n):
        docs = [j for j in range(len(seqs_per_doc)) if (first_doc + j) % n == p]
        if not docs:
            continue
        toks = np.concatenate([tokens[tok_start[seq_start[j]]:tok_start[seq_start[j + 1]]]
                               for j in docs]) if tokens.size else tokens
        lens = [seq_lengths[i] for j in docs for i in range(seq_start[j], seq_start[j + 1])]
        out.append((p, (toks, lens, [seqs_per_doc[j] for j in docs])))
    return out


def output_prefix(args: argparse.Namespace, key: str) -> str:
    """Megatron's name: ``{prefix}_{key}_sentence`` with --split-sentences (one sequence
    per sentence), else ``{prefix}_{key}_document``."""
    level = "sentence" if args.split_sentences else "document"
    return f"{args.output_prefix}_{key}_{level}"


def _progress(n_docs: int, n_tokens: int, n_bytes: int, elapsed: float) -> str:
    elapsed = max(elapsed, 1e-9)
    return (f"{n_docs / elapsed:.1f} docs/s, {n_tokens / elapsed:.0f} tokens/s, "
            f"{n_bytes / elapsed / 1e6:.2f} MB/s")


def preprocess(args: argparse.Namespace) -> Dict[str, float]:
    """Run the whole conversion; returns counts and rates (also printed)."""
    if not os.path.isfile(args.input):
        raise DataError(f"--input {args.input}: no such file (expected a JSON-lines corpus)")
    try:  # the main process needs the dtype and validates the tokenizer
        _init_worker(args)
    except (ValueError, OSError) as exc:  # check_file names the flag (--vocab-file, ...)
        raise UserError(str(exc)) from exc
    # Megatron-LM's --partitions N (without --keep-sequential-samples) writes its
    # documents round-robin into N datasets and concatenates them; so does this, into
    # temporary partition datasets beside the output, merged at the end.
    n_parts = 1 if args.keep_sequential_samples else args.partitions
    builders: Dict[str, List[IndexedDatasetBuilder]] = {}
    part_prefixes: Dict[str, List[str]] = {}
    try:
        Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        for k in args.json_keys:
            builders[k], part_prefixes[k] = [], []
            if n_parts == 1:
                builders[k].append(IndexedDatasetBuilder(output_prefix(args, k) + ".bin",
                                                         _dtype))
                continue
            for p in range(n_parts):
                part = f"{output_prefix(args, k)}.partition{p}.tmp{os.getpid()}"
                builders[k].append(IndexedDatasetBuilder(part + ".bin", _dtype))
                part_prefixes[k].append(part)
    except OSError as exc:
        for builder in chain.from_iterable(builders.values()):
            builder.abort()
        what = f"{exc.filename} ({exc.strerror})" if exc.filename else f"there ({exc})"
        raise UserError(f"--output-prefix {args.output_prefix}: cannot write {what}") from exc
    n_docs = n_tokens = n_bytes = n_empty = 0
    next_log = args.log_interval
    start = time.perf_counter()
    pool = None
    try:
        # Bytes: each line is decoded by _document_texts, which names a line that is
        # not UTF-8 ("\r\n" endings are whitespace to json.loads).
        with open(args.input, "rb") as fin:
            chunks = _chunks(enumerate(fin, start=1), args.chunk_size)
            if args.workers > 1:
                # The worker processes are the parallelism; a thread pool inside each
                # tokenizers backend would only oversubscribe the cores.
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                pool = multiprocessing.Pool(args.workers, initializer=_init_worker,
                                            initargs=(args,))
                results = pool.imap(_encode_chunk, chunks)
            else:
                results = map(_encode_chunk, chunks)
            for docs, nbytes, encoded in results:
                n_bytes += nbytes
                for key, (tokens, seq_lengths, seqs_per_doc) in encoded.items():
                    # A document without tokens stays a document without sequences, as
                    # in Megatron-LM, so document i of every --json-keys output is line i.
                    n_empty += seqs_per_doc.count(0)
                    n_tokens += int(tokens.size)
                    if n_parts == 1:
                        builders[key][0].add_documents(tokens, seq_lengths, seqs_per_doc)
                    else:
                        for p, part in _route(encoded[key], n_docs, n_parts):
                            builders[key][p].add_documents(*part)
                n_docs += docs
                if n_docs >= next_log:
                    next_log = (n_docs // args.log_interval + 1) * args.log_interval
                    print(f"Processed {n_docs} documents ("
                          f"{_progress(n_docs, n_tokens, n_bytes, time.perf_counter() - start)})",
                          file=sys.stderr, flush=True)
        if n_tokens == 0:
            raise DataError(f"--input {args.input}: no tokens to write; found {n_docs} "
                            f"documents under --json-keys {' '.join(args.json_keys)} "
                            f"({n_empty} empty) in {n_bytes} bytes; nothing was written")
        for key, parts in builders.items():
            if n_parts == 1:
                parts[0].finalize(output_prefix(args, key) + ".idx")
                continue
            merged = IndexedDatasetBuilder(output_prefix(args, key) + ".bin", _dtype)
            parts.append(merged)  # aborted with the others on failure
            for part, prefix in zip(parts, part_prefixes[key]):
                part.finalize(prefix + ".idx")
                merged.add_index(prefix)
            merged.finalize(output_prefix(args, key) + ".idx")
    except BaseException:
        for builder in chain.from_iterable(builders.values()):
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for prefix in chain.from_iterable(part_prefixes.values()):
            for ext in (".bin", ".idx"):
                if os.path.exists(prefix + ext):
                    os.unlink(prefix + ext)
    elapsed = time.perf_counter() - start
    print(f"Done: {n_docs} documents, {n_tokens} tokens, {n_bytes} bytes in {elapsed:.3f} s "
          f"({_progress(n_docs, n_tokens, n_bytes, elapsed)}); {n_empty} empty (kept as "
          f"documents without tokens).",
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
    except (UserError, ValueError, FileNotFoundError) as exc:
        exit_with_user_error(exc)  # as run_entry_point would: callers of main() exit too


if __name__ == "__main__":
    from megatron.entry import run_entry_point

    run_entry_point(main)

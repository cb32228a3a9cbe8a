"""Train a SentencePiece model for ``--tokenizer-type SentencePieceTokenizer``.

Example (the demo corpus from tools/make_demo_corpus.py)::

    python tools/train_tokenizer.py --input corpus.jsonl --json-keys text \\
        --vocab-size 4096 --model-type bpe --output-prefix demo_sp

writes ``demo_sp.model`` and ``demo_sp.vocab``.  The model gets a user-defined
``<eod>`` piece (the end-of-document id) and a ``\\n`` piece so that line structure
survives tokenisation; by default it uses byte fallback and identity normalisation,
so any UTF-8 text round-trips exactly.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Iterator, List, Optional, Sequence

EOD_PIECE = "<eod>"

# Half of a UTF-16 pair: json.loads accepts one escaped alone ("\ud800"), but it is not
# Unicode text and SentencePiece cannot take it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _not_utf8(path: str, exc: UnicodeDecodeError) -> ValueError:
    return ValueError(f"--input {path!r}: not UTF-8 text ({exc.reason}); expected a text or "
                      f"JSON-lines file")


def _looks_like_json_lines(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        return isinstance(json.loads(line), dict)
                    except (json.JSONDecodeError, RecursionError):
                        return False
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None
    return False


def iter_documents(path: str, json_keys: Sequence[str], input_format: str) -> Iterator[str]:
    """Yield the documents of one input file: JSON-lines fields or the whole text file."""
    if input_format == "auto":
        input_format = "json" if _looks_like_json_lines(path) else "text"
    try:
        yield from _documents(path, json_keys, input_format)
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None


def _documents(path: str, json_keys: Sequence[str], input_format: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        if input_format == "text":
            yield f.read()
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--input {path!r} line {lineno}: not valid JSON: {exc}") from None
            except RecursionError:
                raise ValueError(f"--input {path!r} line {lineno}: not valid JSON (nested too "
                                 f"deeply)") from None
            if not isinstance(record, dict):
                raise ValueError(f"--input {path!r} line {lineno}: expected a JSON object, "
                                 f"found {type(record).__name__}")
            for key in json_keys:
                if key not in record:
                    raise ValueError(
                        f"--input {path!r} line {lineno}: no key {key!r} (see --json-keys); "
                        f"keys present: {sorted(record)}"
                    )
                text = str(record[key])
                bad = _SURROGATE.search(text)
                if bad:
                    raise ValueError(f"--input {path!r} line {lineno}: {key!r} holds a lone "
                                     f"UTF-16 surrogate {bad.group()!r} (escaped in the JSON), "
                                     f"which is not Unicode text; remove or replace it")
                yield text


def iter_sentences(
    paths: Sequence[str], json_keys: Sequence[str], input_format: str
) -> Iterator[str]:
    """SentencePiece trains on lines; non-empty lines of every document are its sentences."""
    for path in paths:
        for doc in iter_documents(path, json_keys, input_format):
            for line in doc.split("\n"):
                if line.strip():
                    yield line


def train_sentencepiece(args: argparse.Namespace) -> List[str]:
    """Train and write ``<prefix>.model`` / ``<prefix>.vocab``; return their paths."""
    import sentencepiece as spm

    for path in args.input:
        if os.path.isdir(path):
            raise FileNotFoundError(f"--input {path!r} is a directory; expected a text or "
                                    f"JSON-lines file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input: no such file: {path!r}")
    # Line sampling is random; a fixed seed makes the trained model reproducible.
    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(args.seed)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:  # a file where a directory of the prefix should be, no rights
        raise OSError(f"--output-prefix {args.output_prefix}: cannot create the directory "
                      f"{out_dir} ({exc.strerror or exc}); expected a writable "
                      f"directory path") from None
    input_errors: List[Exception] = []
    try:
        _train(spm, args, input_errors)
    except RuntimeError as exc:  # SentencePiece's own checks, e.g. a corpus too small
        if input_errors:  # raised by our reader inside SentencePiece, which wraps it
            raise input_errors[0] from None
        text = str(exc).strip()
        reason = text.split("] ")[-1].strip() if "] " in text else text
        if "sentences_.empty()" in text:
            reason = ("no usable lines (empty, or every line longer than SentencePiece's "
                      "4192-byte limit)")
        raise ValueError(f"SentencePiece could not train on --input "
                         f"{' '.join(args.input)}: {reason}") from None
    return [args.output_prefix + ".model", args.output_prefix + ".vocab"]


def _train(spm, args: argparse.Namespace, input_errors: List[Exception]) -> None:
    def sentences() -> Iterator[str]:
        try:
            yield from iter_sentences(args.input, args.json_keys, args.input_format)
        except (ValueError, OSError) as exc:
            input_errors.append(exc)
            raise

    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(),
        model_prefix=args.output_prefix,
        vocab_size=args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        # Reservoir-sample at most this many lines: bounds time and memory on big corpora.
        input_sentence_size=args.input_sentence_size,
        shuffle_input_sentence=True,
        user_defined_symbols=[EOD_PIECE, "\n"],
        byte_fallback=args.byte_fallback,
        normalization_rule_name=args.normalization_rule_name,
        remove_extra_whitespaces=False,
        hard_vocab_limit=args.hard_vocab_limit,
        num_threads=args.num_threads,
        seed_sentencepiece_size=args.seed_sentencepiece_size,
        minloglevel=0 if args.verbose else 2,
    )


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or loose JSON-lines files")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields holding text")
    p.add_argument("--input-format", choices=("auto", "json", "text"), default="auto")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"), default="bpe")
    p.add_argument("--character-coverage", type=float, default=0.9995)
    p.add_argument("--input-sentence-size", type=int, default=300_000,
                   help="lines sampled for training (0 = all)")
    p.add_argument("--seed-sentencepiece-size", type=int, default=200_000,
                   help="unigram seed pieces (smaller = faster)")
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="map characters outside the vocabulary to <unk> instead of bytes")
    p.add_argument("--normalization-rule-name", default="identity",
                   help="identity keeps text byte-exact; nmt_nfkc is SentencePiece's default")
    p.add_argument("--no-hard-vocab-limit", dest="hard_vocab_limit", action="store_false",
                   help="allow a smaller vocabulary when the corpus is too small")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")
    args = p.parse_args(argv)
    if args.vocab_size < 8:
        p.error(f"--vocab-size must be >= 8, got {args.vocab_size}")
    if args.byte_fallback and args.vocab_size < 300:
        p.error(
            f"--vocab-size {args.vocab_size} is too small for byte fallback (256 byte pieces); "
            "use >= 300 or --no-byte-fallback"
        )
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    start = time.time()
    written = train_sentencepiece(args)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=written[0])
    for path in written:
        print(f"wrote {path} ({os.path.getsize(path) / 1e3:.1f} kB)")
    print(
        f"vocab size {sp.get_piece_size()}, model type {args.model_type}, "
        f"eod {EOD_PIECE!r} = id {sp.piece_to_id(EOD_PIECE)}, {time.time() - start:.1f} s"
    )
    return 0


def _command_line(argv: Optional[Sequence[str]] = None) -> int:
    """``main`` for the shell: its input errors (each names --input or the flag at fault)
    become one ``error:`` line and exit status 2 instead of a traceback."""
    from megatron.errors import UserError

    try:
        return main(argv)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


if __name__ == "__main__":
    import sys
    from pathlib import Path

    # run from a source checkout without installing the package, as the other tools
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron.entry import run_entry_point

    run_entry_point(_command_line)

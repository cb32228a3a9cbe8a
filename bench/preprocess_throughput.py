"""Throughput of tools/preprocess_data.py: documents, tokens and MB per second.

    python bench/preprocess_throughput.py [--quick] [--workers 1 2 4] [--repeat-corpus 4]

Builds a JSON-lines corpus from tinyshakespeare (``../shared/data`` beside the repo;
a generated corpus when absent), runs the real CLI in a subprocess for each tokenizer
(CharTokenizer always, GPT2BPETokenizer when the GPT-2 vocabulary files exist) and
worker count, prints a table and writes ``bench/results/preprocess_throughput.json``.
Rates come from the tool's own "Done:" line: they cover reading, tokenizing and
writing, not interpreter start-up.  ``--quick`` finishes in well under 30 s.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
DONE = re.compile(r"Done: (\d+) documents, (\d+) tokens, (\d+) bytes in ([\d.]+) s")


def make_corpus(path: Path, max_bytes: int, repeat: int) -> str:
    """Write one JSON document per paragraph; returns a description of the source."""
    source = DATA / "corpus" / "tinyshakespeare.txt"
    if source.exists():
        text = source.read_text(encoding="utf-8")[:max_bytes]
        name = f"tinyshakespeare[:{len(text)}] x{repeat}"
    else:
        import random
        rng = random.Random(0)
        words = ["the", "pipeline", "of", "weights", "stage", "micro", "batch", "gradient",
                 "update", "memory", "double", "buffered", "throughput", "model", "data"]
        text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 120)))
                           for _ in range(max_bytes // 400))
        name = f"generated[{len(text)}] x{repeat}"
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(repeat):
            for p in paragraphs:
                f.write(json.dumps({"text": p}) + "\n")
    return name


def tokenizer_configs() -> List[Dict[str, List[str]]]:
    configs = [{"name": "CharTokenizer", "args": ["--tokenizer-type", "CharTokenizer"]}]
    vocab, merges = DATA / "gpt2" / "encoder.json", DATA / "gpt2" / "vocab.bpe"
    if vocab.exists() and merges.exists():
        configs.append({"name": "GPT2BPETokenizer",
                        "args": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                 str(vocab), "--merge-file", str(merges)]})
    return configs


def run_once(corpus: Path, out_prefix: Path, tok_args: List[str], workers: int
             ) -> Dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(corpus),
           "--append-eod", "--workers", str(workers), "--log-interval", "1000000000",
           "--output-prefix", str(out_prefix)] + tok_args
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    match = DONE.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"preprocess_data.py failed:\n{proc.stdout}\n{proc.stderr}")
    docs, tokens, nbytes, seconds = (int(match[1]), int(match[2]), int(match[3]),
                                     float(match[4]))
    seconds = max(seconds, 1e-9)
    return {"documents": docs, "tokens": tokens, "bytes": nbytes, "seconds": seconds,
            "docs_per_s": docs / seconds, "tokens_per_s": tokens / seconds,
            "mb_per_s": nbytes / seconds / 1e6}


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small corpus, 1 and 2 workers")
    p.add_argument("--workers", type=int, nargs="+", default=None)
    p.add_argument("--repeat-corpus", type=int, default=None,
                   help="concatenate the corpus this many times")
    p.add_argument("--output", default=str(ROOT / "bench" / "results" /
                                           "preprocess_throughput.json"))
    args = p.parse_args(argv)
    cpus = os.cpu_count() or 1
    workers = args.workers or ([1, 2] if args.quick else
                               sorted({1, 2, max(1, cpus // 2), cpus}))
    max_bytes = 200_000 if args.quick else 10 ** 9
    repeat = args.repeat_corpus or (1 if args.quick else 4)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        source = make_corpus(corpus, max_bytes, repeat)
        for tok in tokenizer_configs():
            for w in workers:
                stats = run_once(corpus, Path(tmp) / f"{tok['name']}_{w}", tok["args"], w)
                rows.append({"tokenizer": tok["name"], "workers": w, **stats})
                print_row(rows[-1], header=len(rows) == 1)
    result = {"benchmark": "preprocess_throughput", "corpus": source, "quick": args.quick,
              "cpu_count": cpus, "platform": platform.platform(),
              "python": platform.python_version(), "rows": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ncorpus: {source}; wrote {out}")


def print_row(row: Dict, header: bool) -> None:
    if header:
        print(f"{'tokenizer':<18} {'workers':>7} {'docs/s':>10} {'tokens/s':>12} {'MB/s':>8}")
    print(f"{row['tokenizer']:<18} {row['workers']:>7} {row['docs_per_s']:>10.0f} "
          f"{row['tokens_per_s']:>12.0f} {row['mb_per_s']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()

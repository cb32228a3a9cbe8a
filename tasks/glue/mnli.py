"""GLUE MNLI: the original TSV files and the 3-way classification finetuning task.

Columns are found by the header, so every GLUE variant reads the same way: train
(12 columns, ``label1`` + ``gold_label``), dev_matched / dev_mismatched (16 columns,
``label1``..``label5`` + ``gold_label``) and test (10 columns, no label).  Rows are split
on tabs only: MNLI text holds unbalanced quotes that a CSV reader would misparse.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from tasks.data_utils import (ListDataset, ReadReport, build_pair_sample, clean_text, read_text,
                              special_ids)

LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}
NUM_CLASSES = len(LABELS)


@dataclass
class MnliExample:
    uid: str
    premise: str
    hypothesis: str
    label: int
    """Index into LABELS' order, or -1 for unlabelled (test) rows."""


def _column(header: List[str], name: str) -> Optional[int]:
    return header.index(name) if name in header else None


def read_mnli(path: str, require_labels: bool = True) -> Tuple[List[MnliExample], ReadReport]:
    """Examples of one MNLI TSV file and the report of rows that could not be read.

    ``require_labels``: a file without a ``gold_label`` column is an error (training and
    accuracy need labels); with False its rows get label -1.
    """
    report = ReadReport("MNLI", files=[path])
    lines = read_text(path, "a GLUE MNLI TSV file").splitlines()
    if not lines:
        raise ValueError(f"{path}: empty file; expected a GLUE MNLI TSV with a header row")
    header = lines[0].split("\t")
    s1, s2 = _column(header, "sentence1"), _column(header, "sentence2")
    if s1 is None or s2 is None:
        raise ValueError(f"{path}:1: header has no 'sentence1'/'sentence2' columns; is this a "
                         f"GLUE MNLI TSV file? (header: {header[:6]}...)")
    label_col = _column(header, "gold_label")
    if label_col is None and require_labels:
        raise ValueError(f"{path}: no 'gold_label' column (an unlabelled test file?); training "
                         f"and accuracy need labelled files such as dev_matched.tsv")
    uid_col = _column(header, "pairID")
    examples = []
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        row = line.split("\t")
        if len(row) != len(header):
            report.bad(path, lineno, f"expected {len(header)} tab-separated columns, found "
                                     f"{len(row)}")
            continue
        premise, hypothesis = clean_text(row[s1]), clean_text(row[s2])
        if not premise or not hypothesis:
            report.bad(path, lineno, "empty sentence1 or sentence2")
            continue
        label = -1
        if label_col is not None:
            text = row[label_col].strip()
            if text not in LABELS:
                report.bad(path, lineno, f"gold_label {text!r} is not one of "
                                         f"{', '.join(LABELS)}")
                continue
            label = LABELS[text]
        uid = row[uid_col] if uid_col is not None else str(lineno)
        examples.append(MnliExample(uid, premise, hypothesis, label))
    report.samples = len(examples)
    return examples, report


def read_mnli_files(paths: Sequence[str], require_labels: bool = True
                    ) -> Tuple[List[MnliExample], ReadReport]:
    report = ReadReport("MNLI")
    examples: List[MnliExample] = []
    for path in paths:
        ex, rep = read_mnli(path, require_labels)
        examples += ex
        report.merge(rep)
    return examples, report


def build_dataset(name: str, examples: Sequence[MnliExample], tokenizer,
                  max_seq_length: int) -> ListDataset:
    """Tokenized ``[CLS] premise [SEP] hypothesis [SEP]`` samples with labels."""
    cls, sep, pad = special_ids(tokenizer)
    samples = []
    for ex in examples:
        sample = build_pair_sample(tokenizer.tokenize(ex.premise),
                                   tokenizer.tokenize(ex.hypothesis), max_seq_length,
                                   cls, sep, pad)
        sample["label"] = max(ex.label, 0)
        sample["weight"] = 1
        samples.append(sample)
    return ListDataset(name, samples)


def model_provider(cfg, groups, pre_process: bool, post_process: bool):
    from megatron.model.classification import Classification
    from megatron.tensor_parallel.utils import TPInfo

    layers = cfg.parallel.stage_layers(cfg.model.num_layers, groups.pp_rank)
    return Classification(cfg.model, TPInfo.from_groups(groups), num_classes=NUM_CLASSES,
                          pre_process=pre_process, post_process=post_process,
                          layer_numbers=layers, seed=cfg.training.seed)


def main(argv: Optional[List[str]] = None):
    """--task MNLI: finetune a pretrained BERT, accuracy per epoch on each --valid-data."""
    from tasks.finetune_utils import FinetuneTask, finetune

    task = FinetuneTask(
        name="MNLI",
        read=lambda paths: read_mnli_files(paths),
        build=build_dataset,
        model_provider=model_provider,
        # the pooler too: a BERT pretrained with --bert-no-binary-head has none
        head_prefixes=("classification_head.", "pooler."))
    return finetune(task, argv)

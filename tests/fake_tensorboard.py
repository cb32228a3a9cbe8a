"""A stand-in for torch.utils.tensorboard's SummaryWriter that records its scalars, for
tests of --tensorboard-dir without the tensorboard package (not a test dependency)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


class RecordingWriter:
    """Records (tag, value, step) and its constructor's keyword arguments."""

    instances: list = []

    def __init__(self, log_dir=None, **kwargs):
        self.log_dir = log_dir
        self.kwargs = kwargs
        self.rows = []
        RecordingWriter.instances.append(self)

    def add_scalar(self, tag, value, step):
        self.rows.append((tag, float(value), int(step)))

    def flush(self):
        pass

    def close(self):
        pass

    def tags(self):
        return {t for t, _, _ in self.rows}

    def series(self, tag):
        return [(s, v) for t, v, s in self.rows if t == tag]

    def steps(self, tag):
        return [s for t, _, s in self.rows if t == tag]

    def values(self, tag):
        return [v for t, v, _ in self.rows if t == tag]


def install(monkeypatch) -> type:
    """Make ``--tensorboard-dir`` find a tensorboard package whose SummaryWriter is
    RecordingWriter (instances cleared); returns the class."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        importlib.machinery.ModuleSpec(name, None) if name == "tensorboard" else real(name, *a)))
    mod = types.ModuleType("torch.utils.tensorboard")
    mod.SummaryWriter = RecordingWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", mod)
    RecordingWriter.instances = []
    return RecordingWriter

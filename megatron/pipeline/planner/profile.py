"""Profile-based cost functions: measured per-block costs instead of closed forms.

The paper's planner (section 4) prices a configuration with "profile-based cost
functions": the forward/backward time and activation size of one transformer block,
measured once per microbatch size, scaled to any stage.  ``tools/profile_model.py``
writes such a profile (JSON; schema in that file's docstring); this module reads it
and answers, for stage i of d holding ``layers`` blocks at microbatch size b:

* forward / backward seconds: layers x block + embedding (first stage) + head (last);
* bytes stashed per microbatch, exactly as the pipeline executor counts them
  (``megatron.pipeline.memory.StashTracker``): without recomputation the tensors autograd
  saves (layers x block + embedding + head); with recomputation the stage input (s b h values, none
  on the first stage) plus the microbatch's token ids.  A document mask
  (--reset-attention-mask), made once per stage and microbatch, is not in these
  counts: the cost model adds it per stage, as measured by a profile taken with the
  mask (``attention_mask_bytes``), or for a causal profile ``ModelSpec.stage_mask_bytes``
  in the profile's dtype.  Nor are the tensors a stage makes once for all its
  microbatches, RoPE's cos/sin table (measured: ``rotary_table_bytes``) and the explicit
  softmax's [s, s] bool causal mask (``ModelSpec.causal_mask_bytes``): the cost model
  adds them once per stage (``shared_bytes``, ``StageCost.shared_bytes``), as the
  executor's counter charges them;
* optimizer step seconds of the stage's parameters (the last stage of a pipeline also
  updates its copy of the tied word embedding; an untied output layer is part of the
  head);
* the trainer's own work per microbatch beyond the pieces (``overhead``): a profile with
  ``stages`` timed a whole ``GPTModel`` stage of each kind (whole, first, middle, last)
  through ``pretrain_gpt.forward_step``; the overhead of a kind is that time minus the
  pieces the stage is made of, per microbatch size, and is added to every stage of that
  kind whatever its layer count (building the batch and the model's wrappers do not grow
  with layers).  Profiles without ``stages`` give zero.

Sizes the profile did not measure are interpolated linearly between the two nearest
measured sizes and extrapolated linearly from the two nearest ends.  Byte counts are
affine in b (the causal mask does not grow with b), so this is exact for them between
and beyond measured sizes >= 2; at b = 1 the token slice shares its sample's storage
([1, s+1] instead of [1, s]), 8 bytes off the affine line.  Profiles are taken with one
tensor rank; for t > 1 compute time and non-input activations are divided by t (an
approximation: the elementwise work and LayerNorms are not split by Megatron's tensor
parallelism).  With
sequence parallelism they are, and the stage input is split too: every activation is
divided by t (BERT's heads, which run on the whole sequence, and its padding mask still
approximately).  A profile at t = 1 is the same with or without --sequence-parallel, so
profiles do not record it and a plan with it needs no other profile.

Profiles record the two run options that change costs beyond the block's shape
(``check_model``): --fp32-residual-connection (a half-precision profile prices only
plans with its own value; in fp32 it changes nothing) and --reset-attention-mask (a
masked profile prices only masked plans; a causal one prices masked plans with the
causal kernel's times, which ``notes`` says).

    profile = Profile.load("profile.json")
    cm = CostModel(profile.model_spec(num_layers=24), get_hardware("cpu"), profile=profile)
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

from .model_spec import EXPLICIT_SOFTMAX_BACKENDS, ModelSpec

if TYPE_CHECKING:
    from .cost_model import CostOptions

SCHEMA = "megatron-pipedream-profile/1"
PIECES = ("block", "embedding", "head")
ARCH_FIELDS = ("normalization", "position_embedding_type", "rotary_base", "rotary_percent",
               "rope_scaling", "rope_scaling_factor", "swiglu", "qk_layernorm",
               "kv_channels", "num_query_groups", "add_bias_linear", "add_qkv_bias",
               "untie_embeddings_and_output_weights", "attention_backend")
"""ModelConfig's block options a profile records in its "model" (the planner's ModelSpec
and tools/plan.py's flags carry the same names)."""
STAGE_KINDS = ("whole", "first", "middle", "last")
CLOCKS = ("wall", "cpu")
_SIZE_FIELDS = ("hidden_size", "num_attention_heads", "seq_length", "ffn_hidden_size",
                "vocab_size")
# The block's architecture options (``ModelConfig``/``ModelSpec`` names) and their
# defaults: a profile written before they existed is of a GPT-2 block.
_ARCH_DEFAULTS: Dict[str, Any] = {
    "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
    "rotary_base": 10000, "rotary_percent": 1.0, "rope_scaling": False,
    "rope_scaling_factor": 8.0, "swiglu": False, "qk_layernorm": False, "kv_channels": None,
    "num_query_groups": None, "add_bias_linear": True, "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False, "attention_backend": "auto"}
_ARCH_TYPES: Dict[str, tuple] = {
    "normalization": (str,), "position_embedding_type": (str,), "rotary_base": (int,),
    "rotary_percent": (int, float), "rope_scaling": (bool,), "rope_scaling_factor": (int, float),
    "swiglu": (bool,), "qk_layernorm": (bool,), "kv_channels": (int, type(None)),
    "num_query_groups": (int, type(None)),
    "add_bias_linear": (bool,), "add_qkv_bias": (bool,),
    "untie_embeddings_and_output_weights": (bool,), "attention_backend": (str,)}
# what a planned model must share with the profiled one: its sizes and every option that
# changes a cost (RoPE's base, rotated share and frequency scaling change none: left out)
_NO_COST = ("rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor")
_SHAPE_FIELDS = _SIZE_FIELDS + tuple(k for k in _ARCH_DEFAULTS if k not in _NO_COST)
# Options the profile ran with that are not the block's shape (``ModelSpec``'s names;
# older profiles: absent, meaning False).  ``check_model`` has a rule for each.
_RUN_OPTIONS = ("fp32_residual_connection", "reset_attention_mask")
HALF_DTYPES = ("fp16", "bf16")
DTYPES = HALF_DTYPES + ("fp32", "fp64")
"""tools/profile_model.py's --fp16/--bf16/--fp32/--fp64: the precision a planned command
runs in (``search.planned_precision``)."""


def _shown(value: Any, limit: int = 60) -> str:
    """repr(value) for an error line, cut short (a hostile file's value can be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class PieceCost:
    """Per-microbatch cost of one profiled piece at one microbatch size."""

    forward_s: float
    backward_s: float
    stash_bytes: float


@dataclass(frozen=True)
class ProfiledStage:
    """What the cost model needs of one stage, from a profile (per microbatch)."""

    forward_s: float
    backward_s: float
    recompute_s: float
    """Extra backward time with recomputation: the stage's forward, run again."""
    stash_bytes: int
    """Bytes the executor counts per microbatch without recomputation."""
    recompute_stash_bytes: int
    """Bytes it counts per microbatch with recomputation (stage input + token ids)."""
    step_s: float
    """Optimizer step over the stage's parameters, once per batch."""


def _mismatch(key: str, planned: Any, profiled: Any) -> str:
    """A model field the plan and the profile disagree on, as the trainer's flag:
    '--hidden-size 64 (profiled 32)', '--swiglu (profiled without it)'."""
    if key == "add_bias_linear":
        key, planned, profiled = "disable_bias_linear", not planned, not profiled
    flag = f"--{key.replace('_', '-')}"
    if isinstance(planned, bool):
        return f"{flag} (profiled without it)" if planned else f"no {flag} (profiled with it)"
    return f"{flag} {planned} (profiled {profiled})"


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), extended linearly past
    both ends; one point means y proportional to x.  Exact at measured points."""
    if not xs or len(xs) != len(ys):
        raise ValueError("interpolate: need as many (non-zero) xs as ys")
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    lo = min(max(i - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[lo], xs[lo + 1], ys[lo], ys[lo + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class Profile:
    """A loaded profile of one model shape on one device (see the module docstring)."""

    def __init__(self, data: Dict[str, Any], source: str = "<dict>",
                 clock: str = "wall") -> None:
        """``clock``: 'wall' (elapsed time, the default) or 'cpu' (the profiling thread's
        CPU time: what the work costs on a core of its own, for CPU profiles taken with
        one thread on a machine shared with other processes)."""
        self.source = source
        if clock not in CLOCKS:
            raise ValueError(f"profile clock {clock!r}: expected one of {CLOCKS}")
        self.clock = clock
        suffix = "_cpu_s" if clock == "cpu" else "_s"
        if not isinstance(data, dict):
            raise ValueError(f"--profile {source}: expected a JSON object written by "
                             f"tools/profile_model.py, found {type(data).__name__}")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"--profile {source}: schema {data.get('schema')!r}, expected "
                             f"{SCHEMA!r} (written by tools/profile_model.py)")
        try:
            self.model: Dict[str, Any] = self._read_model(data["model"])
            self.device: Dict[str, Any] = self._object(data["device"], "device")
            self.weights: Dict[str, int] = self._object(data["weights"], "weights")
            for key, value in self.weights.items():
                self._number(value, f"weights.{key}")
            self.optimizer_step_s: Dict[str, float] = self._read_optimizer_steps(
                data[f"optimizer_step{suffix}"], f"optimizer_step{suffix}")
            rows = self._read_rows(data["microbatches"], suffix)
            self._tabulate(rows, suffix)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"--profile {source}: malformed profile, missing or not an "
                             f"object: {exc}") from None
        if not rows or len(set(self.micro_batch_sizes)) != len(rows) or \
                min(self.micro_batch_sizes) < 1:
            raise ValueError(f"--profile {source}: needs distinct positive microbatch sizes, "
                             f"got {list(self.micro_batch_sizes)}")
        try:  # the recorded model must be one the planner can price
            self.model_spec()
        except ValueError as exc:
            raise ValueError(f"--profile {source}: {exc}") from None
        self.raw = data

    # -- reading the JSON: ValueError naming the field (KeyError, TypeError: __init__'s)
    def _number(self, value: Any, where: str, integer: bool = False) -> float:
        # a hand-edited or foreign file: a string or null here would surface as a
        # TypeError deep inside the cost model, naming neither the file nor the field
        ok = (isinstance(value, int) if integer else isinstance(value, (int, float)))
        if not ok or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            kind = "a non-negative integer" if integer else "a non-negative number"
            raise ValueError(f"--profile {self.source}: {where} must be {kind}, got "
                             f"{_shown(value)}")
        return value

    def _object(self, value: Any, where: str) -> Dict[str, Any]:
        if not isinstance(value, dict):
            raise ValueError(f"--profile {self.source}: {where} must be a JSON object, got "
                             f"{_shown(value)}")
        return dict(value)

    def _read_model(self, raw: Any) -> Dict[str, Any]:
        """The profile's "model", checked, with the defaults of fields older profiles
        lack filled in."""
        source, num = self.source, self._number
        model = self._object(raw, "model")
        for key in ("num_layers", *_SIZE_FIELDS):
            num(model[key], f"model.{key}", integer=True)
        for key, default in _ARCH_DEFAULTS.items():
            value = model.setdefault(key, default)
            types = _ARCH_TYPES[key]
            if not isinstance(value, types) or (isinstance(value, bool)
                                                and bool not in types):
                raise ValueError(f"--profile {source}: model.{key} must be "
                                 f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
        for key in _RUN_OPTIONS:
            if not isinstance(model.setdefault(key, False), bool):
                raise ValueError(f"--profile {source}: model.{key} must be bool, got "
                                 f"{model[key]!r}")
        if model["num_query_groups"] is None:  # ModelConfig's meaning of None
            model["num_query_groups"] = model["num_attention_heads"]
        heads = model["num_attention_heads"]
        if model["kv_channels"] is None and heads and model["hidden_size"] % heads == 0:
            # ModelConfig's meaning of None (older profiles: h / a); a shape h / a does
            # not divide is left to model_spec(), which names --kv-channels
            model["kv_channels"] = model["hidden_size"] // heads
        for key in ("dtype_bytes", "grad_bytes"):  # bytes per value: 0 is no width
            value = model.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not (math.isfinite(value) and value > 0):
                raise ValueError(f"--profile {source}: model.{key} must be a positive "
                                 f"number, got {_shown(model[key])}")
        if model.get("dtype") is not None and model["dtype"] not in DTYPES:
            raise ValueError(f"--profile {source}: model.dtype must be one of "
                             f"{', '.join(DTYPES)}, got {_shown(model['dtype'])}")
        if not isinstance(model.get("cross_entropy_loss_fusion", False), bool):
            raise ValueError(f"--profile {source}: model.cross_entropy_loss_fusion must be "
                             f"bool, got {_shown(model['cross_entropy_loss_fusion'])}")
        return model

    def _read_optimizer_steps(self, raw: Any, where: str) -> Dict[str, float]:
        """The optimizer step seconds of one clock, checked."""
        steps = self._object(raw, where)
        for key in (*PIECES, "tied_embedding"):
            self._number(steps[key], f"{where}.{key}")
        # once per stage (profiles written before it existed: 0, pieces whole calls)
        self._number(steps.setdefault("fixed", 0.0), f"{where}.fixed")
        return steps

    def _read_rows(self, raw: Any, suffix: str) -> List[Dict[str, Any]]:
        """The "microbatches" rows, checked, by microbatch size."""
        num = self._number
        rows = list(raw)
        for i, r in enumerate(rows):
            where = f"microbatches[{i}]"
            num(r["micro_batch_size"], f"{where}.micro_batch_size", integer=True)
            for name in PIECES:
                for key in (f"forward{suffix}", f"backward{suffix}", "stash_bytes"):
                    num(r[name][key], f"{where}.{name}.{key}")
            for key in ("stage_input_bytes", "data_bytes"):
                num(r[key], f"{where}.{key}")
            # RoPE's table, once per stage (profiles without RoPE, or older: none)
            num(r.get("rotary_table_bytes", 0), f"{where}.rotary_table_bytes")
            # the document mask, once per stage (causal profiles: none)
            num(r.get("attention_mask_bytes", 0), f"{where}.attention_mask_bytes")
            stages = r.get("stages", {})
            if not isinstance(stages, dict):
                raise TypeError("stages")
            for kind, st in stages.items():
                num(st["layers"], f"{where}.stages.{kind}.layers", integer=True)
                for key in (f"forward{suffix}", f"backward{suffix}"):
                    num(st[key], f"{where}.stages.{kind}.{key}")
        rows.sort(key=lambda r: r["micro_batch_size"])
        return rows

    def _tabulate(self, rows: List[Dict[str, Any]], suffix: str) -> None:
        """The per-size tables the cost functions interpolate, from the checked rows."""
        self.micro_batch_sizes: Tuple[int, ...] = tuple(int(r["micro_batch_size"])
                                                        for r in rows)
        self._pieces = {name: [PieceCost(float(r[name][f"forward{suffix}"]),
                                         float(r[name][f"backward{suffix}"]),
                                         r[name]["stash_bytes"]) for r in rows]
                        for name in PIECES}
        self._input = [r["stage_input_bytes"] for r in rows]
        self._overhead = self._stage_overheads(rows, suffix)
        self._data = [r["data_bytes"] for r in rows]
        # s x rotary dims, whatever b is
        self._rotary = int(max((r.get("rotary_table_bytes", 0) for r in rows), default=0))
        self._mask = [r.get("attention_mask_bytes", 0) for r in rows]

    @staticmethod
    def _stage_overheads(rows: List[Dict[str, Any]], suffix: str
                         ) -> Optional[Dict[str, List[Tuple[float, float]]]]:
        """Per stage kind, per row: (forward, backward) seconds of the timed stage minus
        its pieces; None when the profile timed no stages (or not at every size)."""
        if not rows or not all(set(STAGE_KINDS) <= set(r.get("stages", {})) for r in rows):
            return None
        out: Dict[str, List[Tuple[float, float]]] = {}
        for kind in STAGE_KINDS:
            pre, post = kind in ("whole", "first"), kind in ("whole", "last")
            out[kind] = []
            for r in rows:
                st = r["stages"][kind]
                parts = [("block", int(st["layers"]))] + [("embedding", 1)] * pre \
                    + [("head", 1)] * post
                out[kind].append(tuple(
                    float(st[f"{key}{suffix}"]) - sum(float(r[name][f"{key}{suffix}"]) * n
                                                      for name, n in parts)
                    for key in ("forward", "backward")))
        return out

    @classmethod
    def load(cls, path: Union[str, Path], clock: str = "wall") -> "Profile":
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"--profile {path}: no such file (run tools/profile_model.py "
                             "first)") from None
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
            raise ValueError(f"--profile {path}: not JSON ({exc})") from None
        except OSError as exc:
            raise ValueError(f"--profile {path}: cannot read it ({exc.strerror or exc})") from None
        return cls(data, str(path), clock)

    def scaled(self, time_factor: float) -> "Profile":
        """The same profile with every time multiplied by ``time_factor`` (e.g. k ranks
        sharing one core run k times slower); byte counts are unchanged."""
        if time_factor <= 0:
            raise ValueError(f"time_factor must be > 0, got {time_factor}")
        data = json.loads(json.dumps(self.raw))
        suffix = "_cpu_s" if self.clock == "cpu" else "_s"
        for row in data["microbatches"]:
            for name in PIECES:
                for key in ("forward", "backward"):
                    row[name][key + suffix] *= time_factor
            for stage in row.get("stages", {}).values():
                for key in ("forward", "backward"):
                    stage[key + suffix] *= time_factor
        key = f"optimizer_step{suffix}"
        data[key] = {k: v * time_factor for k, v in data[key].items()}
        data.setdefault("settings", {})["time_factor"] = time_factor
        return Profile(data, f"{self.source} x{time_factor:g}", self.clock)

    # -- per piece --------------------------------------------------------------------
    def piece(self, name: str, b: int) -> PieceCost:
        """Forward/backward seconds and stash bytes of one piece at microbatch size b."""
        if name not in self._pieces:
            raise ValueError(f"profile piece {name!r}: expected one of {PIECES}")
        xs, rows = self.micro_batch_sizes, self._pieces[name]
        f = interpolate(xs, [r.forward_s for r in rows], b)
        bw = interpolate(xs, [r.backward_s for r in rows], b)
        st = interpolate(xs, [r.stash_bytes for r in rows], b)
        return PieceCost(max(f, 0.0), max(bw, 0.0), max(round(st), 0))

    def overhead(self, first: bool, last: bool, b: int) -> Tuple[float, float]:
        """(forward, backward) seconds per microbatch the trainer spends on a stage of
        this kind beyond its pieces (zero for a profile without ``stages``).

        Interpolated inside the profiled micro-batch sizes, held at the nearest end
        outside them, and never below zero: the overhead is a difference of two timings
        (the stage minus its pieces), mostly per-call Python, so its slope is noise, and
        a line through two noisy points extrapolated to a larger b once went so negative
        that it cancelled the stage's compute and the planner predicted 18x the measured
        throughput."""
        if self._overhead is None:
            return 0.0, 0.0
        kind = ("whole" if last else "first") if first else ("last" if last else "middle")
        rows = self._overhead[kind]
        xs = self.micro_batch_sizes
        b = min(max(b, xs[0]), xs[-1])
        return (max(interpolate(xs, [r[0] for r in rows], b), 0.0),
                max(interpolate(xs, [r[1] for r in rows], b), 0.0))

    @property
    def has_overhead(self) -> bool:
        return self._overhead is not None

    def stage_input_bytes(self, b: int) -> int:
        """[s, b, h] activation received by a non-first stage."""
        return max(round(interpolate(self.micro_batch_sizes, self._input, b)), 0)

    def data_bytes(self, b: int) -> int:
        """Token ids of one microbatch ([b, s+1] int64), stashed under recomputation."""
        return max(round(interpolate(self.micro_batch_sizes, self._data, b)), 0)

    def attention_mask_bytes(self, b: int) -> int:
        """The document mask a stage of a --reset-attention-mask profile made per
        microbatch, as measured (0 for a causal profile).  Not in ``stage``: the cost
        model charges it once per stage (for a causal profile the closed form,
        ``ModelSpec.stage_mask_bytes``)."""
        return max(round(interpolate(self.micro_batch_sizes, self._mask, b)), 0)

    # -- per stage --------------------------------------------------------------------
    def stage(self, layers: int, first: bool, last: bool, b: int, d: int = 1,
              t: int = 1, sequence_parallel: bool = False) -> ProfiledStage:
        """Costs of a stage of ``layers`` blocks (plus embedding/head where it has them).
        ``sequence_parallel`` (with t > 1): the stage input is each rank's s / t
        positions too, so the whole stash is divided by t, not only what follows it.
        The stash leaves a document mask out (the pieces were counted without it): the
        cost model adds it per stage (``attention_mask_bytes``)."""
        parts: List[Tuple[PieceCost, int]] = [(self.piece("block", b), layers)]
        if first:
            parts.append((self.piece("embedding", b), 1))
        if last:
            parts.append((self.piece("head", b), 1))
        extra_f, extra_b = self.overhead(first, last, b)
        # not divided by t: every tensor rank builds its batch and calls its wrappers
        fwd = max(sum(p.forward_s * n for p, n in parts) / t + extra_f, 0.0)
        bwd = max(sum(p.backward_s * n for p, n in parts) / t + extra_b, 0.0)
        stash = sum(p.stash_bytes * n for p, n in parts)
        inp = 0 if first else self.stage_input_bytes(b)
        if t > 1 and sequence_parallel:
            inp = round(inp / t)
            stash = round(stash / t)
        elif t > 1:
            stash = inp + round((stash - inp) / t)
        steps = self.optimizer_step_s
        step = steps["fixed"] + layers * steps["block"] + (steps["embedding"] if first else 0.0)
        if last:
            tied = not self.model["untie_embeddings_and_output_weights"]
            step += steps["head"] + (steps["tied_embedding"] if d > 1 and tied else 0.0)
        return ProfiledStage(forward_s=fwd, backward_s=bwd, recompute_s=fwd,
                             stash_bytes=int(stash),
                             recompute_stash_bytes=inp + self.data_bytes(b), step_s=step / t)

    def stage_stash_bytes(self, layers: int, first: bool, last: bool, b: int,
                          recompute: bool = False) -> int:
        """Bytes the executor's counter charges one microbatch alone in flight on such a
        stage: with a --reset-attention-mask profile its measured mask too, and the
        stage's shared tensors (``shared_bytes``: RoPE's table, the explicit softmax's
        causal mask), which the counter charges once however many microbatches are in
        flight, as the cost model does (``StageCost.shared_bytes``); under
        recomputation, where the forward keeps nothing but the input and the ids,
        neither."""
        st = self.stage(layers, first, last, b)
        if recompute:
            return st.recompute_stash_bytes
        once = self.attention_mask_bytes(b) + self.shared_bytes(layers)
        return st.stash_bytes + (once if layers > 0 else 0)

    def shared_bytes(self, layers: int) -> int:
        """What a stage of ``layers`` blocks makes once and keeps for all its microbatches:
        RoPE's cos/sin table (``RotaryEmbedding``'s cache, the same on every tensor rank)
        and the explicit softmax's [s, s] causal mask (``StageCost.shared_bytes``)."""
        if layers <= 0:
            return 0
        return self._rotary + int(self.model_spec().causal_mask_bytes())

    # -- the model it was taken of ------------------------------------------------------
    def grad_bytes(self) -> float:
        """Bytes per gradient element in the trainer the profile stands for: 4 under
        bf16 (gradients accumulate in float32), else the weights' (older profiles: the
        weights')."""
        return float(self.model.get("grad_bytes", self.model.get("dtype_bytes", 2)))

    def cost_options(self, options: "CostOptions") -> "CostOptions":
        """``options`` with this profile's gradient width: in the data-parallel
        all-reduce and, in place of the default fp16 gradient, in the optimizer state."""
        from dataclasses import replace
        g = self.grad_bytes()
        return replace(options, grad_bytes_per_param=g,
                       optimizer_bytes_per_param=(options.optimizer_bytes_per_param
                                                  - options.grad_bytes_per_param + g))

    def model_spec(self, num_layers: Optional[int] = None, name: str = "") -> ModelSpec:
        """The ``ModelSpec`` of the profiled shape (``num_layers`` defaults to the profile's)."""
        m = self.model
        return ModelSpec(num_layers=int(num_layers or m["num_layers"]),
                         hidden_size=m["hidden_size"],
                         num_attention_heads=m["num_attention_heads"],
                         seq_length=m["seq_length"], vocab_size=m["vocab_size"],
                         ffn_hidden_size=m["ffn_hidden_size"], kind=m.get("kind", "gpt"),
                         name=name or f"profiled {m.get('kind', 'gpt')}",
                         **{k: m[k] for k in (*_ARCH_DEFAULTS, *_RUN_OPTIONS)})

    def check_model(self, model: ModelSpec) -> None:
        """Raise ValueError when ``model`` does not have the profiled block shape, or
        runs with options whose costs the profile did not measure: a half-precision
        profile's --fp32-residual-connection must be the plan's (an fp32 profile's
        stream is float32 either way), and a --reset-attention-mask profile (timed with
        the masked kernel) prices only plans with the mask.  A causal profile prices a
        masked plan with the causal kernel's times (``notes``)."""
        if model.kind != self.model.get("kind", "gpt"):
            raise ValueError(f"--profile {self.source}: profiled a {self.model.get('kind')} "
                             f"model, planning a {model.kind} model")
        wrong = [_mismatch(k, getattr(model, k), self.model[k])
                 for k in _SHAPE_FIELDS if getattr(model, k) != self.model[k]
                 and not (k == "kv_channels" and self._default_heads(model))
                 and not (k == "num_query_groups" and self._multi_head(model))
                 and not (k == "attention_backend" and self._same_attention(model))]
        if wrong:
            raise ValueError(f"--profile {self.source} was taken for another model shape: "
                             + ", ".join(wrong))
        dtype = self.model.get("dtype")
        profiled, planned = (self.model["fp32_residual_connection"],
                             model.fp32_residual_connection)
        if dtype in HALF_DTYPES and planned != profiled:
            # a float32 stream doubles the stage inputs and the norms' inputs, which a
            # half-precision profile measured in its own width (or the other way round);
            # in an fp32 profile the stream is float32 either way
            word = {True: "with", False: "without"}
            raise ValueError(f"--profile {self.source} was taken in {dtype} {word[profiled]} "
                             f"--fp32-residual-connection, planning {word[planned]} it: "
                             f"profile {word[planned]} the flag (tools/profile_model.py), or "
                             f"plan without --profile (the closed forms count it)")
        if self.model["reset_attention_mask"] and not model.reset_attention_mask:
            raise ValueError(f"--profile {self.source} was taken with --reset-attention-mask "
                             f"(its attention times are the masked kernel's), planning causal "
                             f"attention: profile without the flag, or plan with it")

    def notes(self, model: ModelSpec) -> List[str]:
        """What a plan of ``model`` (accepted by ``check_model``) should know about this
        profile's costs, one line each."""
        out = []
        if model.reset_attention_mask and not self.model["reset_attention_mask"]:
            out.append(f"--profile {self.source} was taken with causal attention: the "
                       f"--reset-attention-mask plan counts the mask's memory but times the "
                       f"causal kernel (on a GPU the masked one is slower; profile with "
                       f"--reset-attention-mask to time it)")
        return out

    def _same_attention(self, model: ModelSpec) -> bool:
        """auto, flash and fused run the same kernels (torch picks), as unfused and
        local run the same explicit softmax."""
        return model.keeps_scores == (self.model["attention_backend"]
                                      in EXPLICIT_SOFTMAX_BACKENDS)

    def _default_heads(self, model: ModelSpec) -> bool:
        """Both the plan and the profile have heads of hidden / heads: a head size that
        differs follows from --hidden-size or --num-attention-heads, named already."""
        m = self.model
        return (not model.custom_head_dim
                and m["kv_channels"] * m["num_attention_heads"] == m["hidden_size"])

    def _multi_head(self, model: ModelSpec) -> bool:
        """Neither the plan nor the profile groups its keys and values: a group count that
        differs follows from --num-attention-heads, named already."""
        return (not model.grouped_query
                and self.model["num_query_groups"] == self.model["num_attention_heads"])

    def describe(self) -> str:
        d, m = self.device, self.model
        return (f"profile {self.source}: {d.get('name')} ({d.get('type')}, "
                f"{d.get('threads')} threads, torch {d.get('torch')}), {m.get('dtype')}, "
                f"b in {list(self.micro_batch_sizes)}, {self.clock} clock"
                + (", fp32 residual stream" if m["fp32_residual_connection"] else "")
                + (", document attention mask" if m["reset_attention_mask"] else "")
                + ("" if self.has_overhead else ", no stage overhead"))

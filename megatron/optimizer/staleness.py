"""Opt-in mitigations of PipeDream-2BW's 1-stale update (``--2bw-mitigation``).

2BW applies batch t's gradient, taken at W(t-1), to W(t) (paper section 3.1).  Early in
training the weights move fast and that delay costs loss.  Each mitigation keeps 2BW's
schedule (no flush) and its two weight buffers per stage:

* ``predict`` (weight prediction): batch t runs its forward and backward passes on
  P(W(t-1)), the optimizer's own prediction of W(t): the next update from the current
  optimizer state with a zero gradient (AdamW: decay, then the step along the decayed
  first moment; SGD: decay plus the momentum step).  The gradient is then taken close to
  the weights it is applied to.  The buffers hold predicted weights; the true weights are
  the fp32 masters under fp16/bf16, and in fp32/float64 runs they are recovered from the
  buffer by inverting the prediction (the optimizer state that made it is still there),
  so no third copy exists.  Rule: W(t+1) = W(t) - lr * update(grad f(P_t(W(t-1)))), where
  P_t uses the state and learning rate of step t-1.
* ``dc`` (delay compensation, DC-ASGD, Zheng et al. 2017): the stale gradient is moved to
  the latest weights with the first-order, diagonal-Hessian correction
  g + lambda * g * g * (W(t) - W(t-1)), using the two versions a stage holds anyway.
* ``warmup``: Flush semantics (no delay) for the first N iterations, then 2BW; handled by
  the pipeline engine, which changes schedule at iteration N.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

MITIGATIONS = ("none", "predict", "dc", "warmup")

# (c, num, denom, coef) of P(W) = c * W + coef * num / denom (denom None: coef * num).
# AdamW's denom is sqrt(k * v) + eps, given as (v, k', eps) with k' = sqrt(k) and made
# when needed (``_denoms``), so a chunk of parameters makes all of its denoms at once.
_Denom = Tuple[torch.Tensor, float, float]
_Terms = Tuple[float, torch.Tensor, Optional[_Denom], float]


def _denom(spec: _Denom) -> torch.Tensor:
    """sqrt(v) * k' + eps of one (v, k', eps): ``_denoms`` for a single tensor."""
    v, k, eps = spec
    return v.sqrt().mul_(k).add_(eps)


def _denoms(specs: List[_Denom]) -> List[torch.Tensor]:
    """sqrt(v) * k' + eps of each (v, k', eps), in three multi-tensor passes."""
    out = torch._foreach_sqrt([v for v, _, _ in specs])
    torch._foreach_mul_(out, [k for _, k, _ in specs])
    torch._foreach_add_(out, [eps for _, _, eps in specs])
    return out


CHUNK_BYTES = 256 * 2 ** 20
"""Weights per multi-tensor pass of ``WeightPrediction.predict_`` (bounds its temporaries)."""


def use_foreach(params: Sequence[torch.Tensor]) -> bool:
    """Chunks of many tensors on accelerators; one tensor per chunk on the CPU."""
    return len(params) > 0 and params[0].device.type != "cpu"


def _predict_chunk(items: List[Tuple[torch.Tensor, torch.Tensor, _Terms]]) -> None:
    """d := P(s) for each (d, s, terms) of a chunk: c * s, then + coef * num / denom.

    In place where s is d's storage in d's dtype; otherwise P(s) is computed in the
    state's dtype (s's fp32 master, or a copy of s) and cast into d."""
    adam = [(d, s, t) for d, s, t in items if t[2] is not None]
    sgd = [(d, s, t) for d, s, t in items if t[2] is None]
    for group in (adam, sgd):
        if not group:
            continue
        dsts = [d for d, _, _ in group]
        nums = [t[1] for _, _, t in group]
        in_place = [s.data_ptr() == d.data_ptr() and s.dtype == d.dtype for d, s, _ in group]
        # w: the tensor P is computed in (d itself, or a temporary in the state's dtype)
        work = [d if ip else (s if s.dtype == n.dtype else s.to(n.dtype))
                for (d, s, _), n, ip in zip(group, nums, in_place)]
        cs = [t[0] for _, _, t in group]
        temps = [i for i, ip in enumerate(in_place) if not ip]
        if temps:  # c * s into fresh tensors: s (a master, or the source) stays as it is
            scaled = torch._foreach_mul([work[i] for i in temps], [cs[i] for i in temps])
            for i, w in zip(temps, scaled):
                work[i] = w
        inplace = [i for i, ip in enumerate(in_place) if ip]
        if inplace:
            torch._foreach_mul_([work[i] for i in inplace], [cs[i] for i in inplace])
        coefs = [t[3] for _, _, t in group]
        if group is adam:
            torch._foreach_addcdiv_(work, nums, _denoms([t[2] for _, _, t in group]), coefs)
        else:
            _add_scaled_(work, nums, coefs)
        if temps:
            torch._foreach_copy_([dsts[i] for i in temps], [work[i] for i in temps])


def _restore_chunk(items: List[Tuple[torch.Tensor, _Terms]]) -> None:
    """p := (p - coef * num / denom) / c for each (p, terms), in place."""
    adam = [(p, t) for p, t in items if t[2] is not None]
    sgd = [(p, t) for p, t in items if t[2] is None]
    if adam:
        ps = [p for p, _ in adam]
        torch._foreach_addcdiv_(ps, [t[1] for _, t in adam], _denoms([t[2] for _, t in adam]),
                                [-t[3] for _, t in adam])
        torch._foreach_div_(ps, [t[0] for _, t in adam])
    if sgd:
        ps = [p for p, _ in sgd]
        _add_scaled_(ps, [t[1] for _, t in sgd], [-t[3] for _, t in sgd])
        torch._foreach_div_(ps, [t[0] for _, t in sgd])


def _add_scaled_(ws: List[torch.Tensor], nums: List[torch.Tensor], coefs: List[float]) -> None:
    """w += coef * num for each triple, as ``w.add_(num, alpha=coef)`` computes it (one
    multi-tensor call per distinct coef: a parameter group's)."""
    for coef in dict.fromkeys(coefs):
        idx = [i for i, c in enumerate(coefs) if c == coef]
        torch._foreach_add_([ws[i] for i in idx], [nums[i] for i in idx], alpha=coef)


def _group_index(optimizer: torch.optim.Optimizer) -> Dict[int, int]:
    """The index of each parameter's group (torch's ``load_state_dict`` replaces the
    group dicts, so they are looked up by index at each use)."""
    return {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}


def _weight_decays(optimizer: torch.optim.Optimizer) -> List[float]:
    return [g.get("weight_decay", 0.0) for g in optimizer.param_groups]


class WeightPrediction:
    """The zero-gradient look-ahead of AdamW or SGD: P(W) = c * W - a, per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, main_params: Sequence[nn.Parameter],
                 decoupled: Optional[Sequence[bool]] = None):
        self.optimizer = optimizer
        self.main_params = list(main_params)
        self._group = _group_index(optimizer)
        self.decoupled = None if decoupled is None else list(decoupled)
        """Per main parameter: it follows --decoupled-lr (None: none does)."""
        self.last_lr = 0.0
        """Learning rate the buffers' current predictions were made with."""
        self.last_decoupled_lr = 0.0
        """The same for the ``decoupled`` parameters."""
        self.last_wd: Optional[List[float]] = None
        """Each group's weight decay when the predictions were made (None: the groups'
        own now).  A scheduled weight decay (--weight-decay-incr-style) is set on the
        groups before ``restore_`` inverts the last prediction, which used the old one."""

    def _lrs(self, lr: float, decoupled_lr: Optional[float]) -> List[float]:
        """Each main parameter's rate: ``decoupled_lr`` (default ``lr``) for the
        decoupled ones, ``lr`` for the others."""
        if self.decoupled is None:
            return [lr] * len(self.main_params)
        other = lr if decoupled_lr is None else decoupled_lr
        return [other if flag else lr for flag in self.decoupled]

    def _terms(self, main: nn.Parameter, lr: float,
               wds: Optional[List[float]] = None) -> Optional[_Terms]:
        """P(W) = c * W + coef * num / denom from ``main``'s optimizer state; None when the
        parameter has no state yet (before its first update there is nothing to predict).
        ``wds``: each group's weight decay (default: the groups' own)."""
        state = self.optimizer.state.get(main)
        if not state:
            return None
        k = self._group[id(main)]
        group = self.optimizer.param_groups[k]
        c = 1.0 - lr * (group.get("weight_decay", 0.0) if wds is None else wds[k])
        if "exp_avg" in state:  # AdamW, as torch.optim.AdamW with grad = 0
            beta1, beta2 = group["betas"]
            step = float(state["step"]) + 1.0
            bc1 = 1.0 - beta1 ** step
            bc2 = 1.0 - beta2 ** step
            # sqrt(beta2 * v / bc2) + eps, then the step along beta1 * m / bc1
            denom = (state["exp_avg_sq"], math.sqrt(beta2 / bc2), group["eps"])
            return c, state["exp_avg"], denom, -lr * beta1 / bc1
        buf = state.get("momentum_buffer")  # SGD (L2 decay enters the momentum)
        if buf is None:
            return None
        return c, buf, None, -lr * group["momentum"]

    @torch.no_grad()
    def predict_(self, dst: Sequence[nn.Parameter], src: Sequence[torch.Tensor],
                 lr: float, decoupled_lr: Optional[float] = None) -> None:
        """dst := P(src) with the current state and ``lr`` (``decoupled_lr``, default
        ``lr``, for the ``decoupled`` parameters; dst may be low precision; src may be
        dst's own tensor, then the prediction is made in place).

        On an accelerator: multi-tensor (``torch._foreach_*``) passes over chunks of
        at most ``CHUNK_BYTES`` of weights, a few kernel launches per chunk instead of
        several per parameter (on an H100 the per-parameter loop took 26 ms of a 66 ms
        GPT-124M iteration), with temporaries of one chunk's size.  On the CPU, where
        the multi-tensor ops are a loop too (a one-off timing of a small GPT stage had
        them 1.25x slower; no bench records it), one parameter at a time.  Both run the
        same operations in the same order (c * W, then + coef * num / denom), so they
        give the same values (tests/unit/test_staleness.py)."""
        pending: List[Tuple[torch.Tensor, torch.Tensor, _Terms]] = []
        size = 0
        foreach = use_foreach(dst)
        lrs = self._lrs(lr, decoupled_lr)
        for main, d, s, lr_k in zip(self.main_params, dst, src, lrs):
            terms = self._terms(main, lr_k)
            in_place = s.data_ptr() == d.data.data_ptr() and s.dtype == d.dtype
            if terms is None:  # no state yet: nothing to predict
                if not in_place:
                    d.data.copy_(s)
                continue
            if not foreach:
                c, num, spec, coef = terms
                w = s if in_place else s.to(num.dtype, copy=True)
                w.mul_(c)
                if spec is None:
                    w.add_(num, alpha=coef)
                else:
                    w.addcdiv_(num, _denom(spec), value=coef)
                if not in_place:
                    d.data.copy_(w)
                continue
            pending.append((d.data, s, terms))
            size += s.numel() * terms[1].element_size()
            if size >= CHUNK_BYTES:
                _predict_chunk(pending)
                pending, size = [], 0
        if pending:
            _predict_chunk(pending)
        self.last_lr = lr
        self.last_decoupled_lr = lr if decoupled_lr is None else decoupled_lr
        self.last_wd = _weight_decays(self.optimizer)

    @torch.no_grad()
    def restore_(self, buf: Sequence[nn.Parameter]) -> None:
        """Invert the prediction in place: W = (P(W) - coef * num / denom) / c (same state,
        ``last_lr`` and ``last_wd``); multi-tensor passes over chunks, as ``predict_``."""
        chunk: List[Tuple[torch.Tensor, _Terms]] = []
        size = 0
        foreach = use_foreach(buf)
        lrs = self._lrs(self.last_lr, self.last_decoupled_lr)
        for main, p, lr_k in zip(self.main_params, buf, lrs):
            terms = self._terms(main, lr_k, self.last_wd)
            if terms is None:
                continue
            if not foreach:
                c, num, spec, coef = terms
                if spec is None:
                    p.data.add_(num, alpha=-coef)
                else:
                    p.data.addcdiv_(num, _denom(spec), value=-coef)
                p.data.div_(c)
                continue
            chunk.append((p.data, terms))
            size += p.numel() * p.element_size()
            if size >= CHUNK_BYTES:
                _restore_chunk(chunk)
                chunk, size = [], 0
        if chunk:
            _restore_chunk(chunk)

    def state_dict(self) -> dict:
        if self.decoupled is None:  # as before --decoupled-lr
            return {"last_lr": self.last_lr}
        return {"last_lr": self.last_lr, "last_decoupled_lr": self.last_decoupled_lr}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        self.last_lr = float(sd["last_lr"]) if sd else 0.0
        # saved without decoupled parameters: they were predicted with the one rate
        self.last_decoupled_lr = (float(sd.get("last_decoupled_lr", self.last_lr)) if sd
                                  else 0.0)
        # the optimizer's groups were loaded first: they hold the weight decay of the
        # checkpoint's last step, the one its predictions were made with
        self.last_wd = _weight_decays(self.optimizer)


@torch.no_grad()
def delay_compensate_(grads: List[Optional[torch.Tensor]], stale: Sequence[nn.Parameter],
                      latest: Sequence[nn.Parameter], lam: float) -> None:
    """g += lam * g * g * (W_latest - W_stale), in place (DC-ASGD's first-order term)."""
    for g, s, w in zip(grads, stale, latest):
        if g is None or s is w:
            continue
        diff = w.data.to(g.dtype) - s.data.to(g.dtype)
        g.add_(g * g * diff, alpha=lam)


@contextmanager
def true_weights(prediction: Optional[WeightPrediction], buf: Sequence[nn.Parameter],
                 masters: Optional[Sequence[nn.Parameter]]) -> Iterator[None]:
    """Inside: ``buf`` holds the true latest weights (for evaluation); after: the
    prediction again, bit for bit.  With fp32 masters the true weights are the masters'
    and the prediction is made from them again (exact).  Without (an fp32 run, whose
    main parameters are the buffer) the true weights are the inverted prediction, and the
    prediction's own bits are kept aside meanwhile (one copy of the stage's weights): made
    again from the inversion, (P(W) + a) / c * c - a could differ from P(W) in the last
    bit, and a run that evaluates would drift from one that does not."""
    if prediction is None:
        yield
        return
    kept = None
    with torch.no_grad():
        if masters is not None:
            for p, m in zip(buf, masters):
                p.data.copy_(m.data)
        else:
            kept = [p.data.clone() for p in buf]
            prediction.restore_(buf)
    try:
        yield
    finally:
        with torch.no_grad():
            if kept is not None:
                for p, k in zip(buf, kept):
                    p.data.copy_(k)
            else:
                # per parameter: P(W) is computed into a temporary of one tensor's size
                prediction.predict_(buf, [m.data for m in masters], prediction.last_lr,
                                    prediction.last_decoupled_lr)

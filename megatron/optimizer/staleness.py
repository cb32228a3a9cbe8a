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

# (c, num, denom, coef) of P(W) = c * W + coef * num / denom (denom None: coef * num)
_Terms = Tuple[float, torch.Tensor, Optional[torch.Tensor], float]


def _apply(w: torch.Tensor, terms: _Terms) -> None:
    """w := P(w), in place, in two element-wise passes."""
    c, num, denom, coef = terms
    w.mul_(c)
    if denom is None:
        w.add_(num, alpha=coef)
    else:
        w.addcdiv_(num, denom, value=coef)


def _groups_by_param(optimizer: torch.optim.Optimizer) -> Dict[int, dict]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


class WeightPrediction:
    """The zero-gradient look-ahead of AdamW or SGD: P(W) = c * W - a, per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, main_params: Sequence[nn.Parameter]):
        self.optimizer = optimizer
        self.main_params = list(main_params)
        self._group = _groups_by_param(optimizer)
        self.last_lr = 0.0
        """Learning rate the buffers' current predictions were made with."""

    def _terms(self, main: nn.Parameter, lr: float) -> Optional[_Terms]:
        """P(W) = c * W + coef * num / denom from ``main``'s optimizer state; None when the
        parameter has no state yet (before its first update there is nothing to predict)."""
        state = self.optimizer.state.get(main)
        if not state:
            return None
        group = self._group[id(main)]
        c = 1.0 - lr * group.get("weight_decay", 0.0)
        if "exp_avg" in state:  # AdamW, as torch.optim.AdamW with grad = 0
            beta1, beta2 = group["betas"]
            step = float(state["step"]) + 1.0
            bc1 = 1.0 - beta1 ** step
            bc2 = 1.0 - beta2 ** step
            # sqrt(beta2 * v / bc2) + eps, then the step along beta1 * m / bc1
            denom = state["exp_avg_sq"].sqrt().mul_(math.sqrt(beta2 / bc2)).add_(group["eps"])
            return c, state["exp_avg"], denom, -lr * beta1 / bc1
        buf = state.get("momentum_buffer")  # SGD (L2 decay enters the momentum)
        if buf is None:
            return None
        return c, buf, None, -lr * group["momentum"]

    @torch.no_grad()
    def predict_(self, dst: Sequence[nn.Parameter], src: Sequence[torch.Tensor],
                 lr: float) -> None:
        """dst := P(src) with the current state and ``lr`` (dst may be low precision; src
        may be dst's own tensor, then the prediction is made in place)."""
        for main, d, s in zip(self.main_params, dst, src):
            terms = self._terms(main, lr)
            in_place = s.data_ptr() == d.data.data_ptr() and s.dtype == d.dtype
            if terms is None:
                if not in_place:
                    d.data.copy_(s)
                continue
            w = s if in_place else s.to(terms[1].dtype, copy=True)
            _apply(w, terms)
            if not in_place:
                d.data.copy_(w)
        self.last_lr = lr

    @torch.no_grad()
    def restore_(self, buf: Sequence[nn.Parameter]) -> None:
        """Invert the prediction in place: W = (P(W) - coef * num / denom) / c (same state,
        ``last_lr``)."""
        for main, p in zip(self.main_params, buf):
            terms = self._terms(main, self.last_lr)
            if terms is not None:
                c, num, denom, coef = terms
                if denom is None:
                    p.data.add_(num, alpha=-coef)
                else:
                    p.data.addcdiv_(num, denom, value=-coef)
                p.data.div_(c)

    def state_dict(self) -> dict:
        return {"last_lr": self.last_lr}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        self.last_lr = float(sd["last_lr"]) if sd else 0.0


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
    prediction again.  With fp32 masters this is exact; otherwise the round trip
    (P(W) + a) / c * c - a may differ from P(W) in the last bit."""
    if prediction is None:
        yield
        return
    with torch.no_grad():
        if masters is not None:
            for p, m in zip(buf, masters):
                p.data.copy_(m.data)
        else:
            prediction.restore_(buf)
    try:
        yield
    finally:
        # per parameter: P(W) is computed into a temporary of one tensor's size
        source = [m.data for m in masters] if masters is not None else [p.data for p in buf]
        prediction.predict_(buf, source, prediction.last_lr)

"""Why 2BW's one-step delay costs so much at a high learning rate: stability of the update.

A linear-stability model of the optimizers the convergence benches compare.  On a
quadratic f(x) = lam/2 x^2 in a direction of (preconditioned) curvature lam, Adam's update
with momentum beta1 is, away from its bias-correction start-up and with its per-coordinate
scale folded into the step size eta,

    m(t+1) = beta1 m(t) + (1 - beta1) g(t),      x(t+1) = x(t) - eta m(t+1)

where g(t) is taken at

    flush (vanilla):            x(t)
    2bw (1-stale):              x(t-1)
    2bw+predict:                x(t-1) - eta beta1 m(t-1)   (the next update with a zero gradient)

Each rule is a linear recurrence in (x(t), x(t-1), m(t), m(t-1)); it is stable while the
spectral radius of its matrix stays below 1.  The bench finds, for each beta1, the
largest stable eta*lam by bisection.  Training at a high learning rate runs at the edge of
this bound (the sharpness of the loss rises until the bound is met; Cohen et al., 2022,
"Adaptive gradient methods at the edge of stability"), so a rule with a lower bound must
keep the model in flatter regions: the loss gap the benches measure early in training.

    PYTHONPATH=. python bench/delay_stability.py

prints the table, writes delay_stability.json and docs/figures/delay_stability.png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO_ROOT, figure_entry, format_table, write_results  # noqa: E402

FIGURE = REPO_ROOT / "docs" / "figures" / "delay_stability.png"
RULES = ("flush", "2bw", "2bw+predict")
BETAS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99)


def update_matrix(rule: str, beta: float, a: float) -> np.ndarray:
    """The map (x_t, x_{t-1}, m_t, m_{t-1}) -> (x_{t+1}, x_t, m_{t+1}, m_t) with a = eta*lam
    (m carries the step size: the step is x_{t+1} = x_t - m_{t+1})."""
    # gradient point e = cx . (x_t, x_{t-1}, m_t, m_{t-1})
    e = {"flush": [1.0, 0.0, 0.0, 0.0],
         "2bw": [0.0, 1.0, 0.0, 0.0],
         "2bw+predict": [0.0, 1.0, 0.0, -beta]}[rule]
    e = np.array(e)
    m_next = beta * np.array([0.0, 0.0, 1.0, 0.0]) + (1.0 - beta) * a * e
    x_next = np.array([1.0, 0.0, 0.0, 0.0]) - m_next
    return np.stack([x_next, [1.0, 0.0, 0.0, 0.0], m_next, [0.0, 0.0, 1.0, 0.0]])


def stable(rule: str, beta: float, a: float) -> bool:
    return float(np.max(np.abs(np.linalg.eigvals(update_matrix(rule, beta, a))))) < 1.0 - 1e-12


def threshold(rule: str, beta: float, hi: float = 1e4, iters: int = 60) -> float:
    """Largest eta*lam for which the rule is stable (bisection; stable for small a)."""
    lo = 1e-6
    if not stable(rule, beta, lo):
        return 0.0
    while stable(rule, beta, hi):
        hi *= 2.0
    for _ in range(iters):
        mid = (lo * hi) ** 0.5 if hi / lo > 4 else (lo + hi) / 2
        lo, hi = (mid, hi) if stable(rule, beta, mid) else (lo, mid)
    return lo


def simulate(rule: str, beta: float, a: float, steps: int) -> List[float]:
    """x(1..steps) from x = 1, m = 0, the update written out as the optimizer runs it (a
    check that the matrix encodes the rule)."""
    x_prev = x = 1.0
    m_prev = m = 0.0
    out = []
    for _ in range(steps):
        e = {"flush": x, "2bw": x_prev, "2bw+predict": x_prev - beta * m_prev}[rule]
        m_new = beta * m + (1.0 - beta) * a * e
        x_prev, x, m_prev, m = x, x - m_new, m, m_new
        out.append(x)
    return out


def matrix_trajectory(rule: str, beta: float, a: float, steps: int) -> List[float]:
    mat, s = update_matrix(rule, beta, a), np.array([1.0, 1.0, 0.0, 0.0])
    out = []
    for _ in range(steps):
        s = mat @ s
        out.append(float(s[0]))
    return out


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    betas = np.linspace(0.0, 0.99, 100)
    styles = {"flush": ("PipeDream-Flush (vanilla Adam)", "tab:blue", "-"),
              "2bw": ("PipeDream-2BW (1-stale)", "tab:red", "--"),
              "2bw+predict": ("2BW + weight prediction", "tab:green", "-")}
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for rule in RULES:
        label, color, ls = styles[rule]
        ax.plot(betas, [threshold(rule, b) for b in betas], color=color, ls=ls, label=label)
    ax.axvline(0.9, color="grey", lw=0.8, ls=":")
    ax.text(0.895, 1.3, "Adam's default beta1 = 0.9", fontsize=8, color="grey", ha="right")
    ax.set_yscale("log")
    ax.set(xlabel="momentum beta1", ylabel="largest stable eta x curvature",
           title="Stable step size of Adam-style updates on a quadratic")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default=None, help="where to write delay_stability.json")
    p.add_argument("--figure", default=None, help=f"PNG to write (default {FIGURE})")
    args = p.parse_args(argv)
    rows = []
    for beta in BETAS:
        th = {rule: threshold(rule, beta) for rule in RULES}
        # the matrix and the written-out update agree on both sides of each bound
        for rule, a in th.items():
            for f in (0.5, 2.0):
                if not np.allclose(simulate(rule, beta, f * a, 60),
                                   matrix_trajectory(rule, beta, f * a, 60), rtol=1e-9):
                    raise RuntimeError(f"{rule} at beta1={beta}: the matrix does not "
                                       f"reproduce the update")
        rows.append({"beta1": beta, **{f"{r}_max_eta_lam": th[r] for r in RULES},
                     "flush_over_2bw": th["flush"] / th["2bw"],
                     "flush_over_predict": th["flush"] / th["2bw+predict"]})
    print(format_table(["beta1", "flush", "2bw", "2bw+predict", "flush/2bw",
                        "flush/predict"],
                       [[r["beta1"], r["flush_max_eta_lam"], r["2bw_max_eta_lam"],
                         r["2bw+predict_max_eta_lam"], r["flush_over_2bw"],
                         r["flush_over_predict"]] for r in rows],
                       title="largest stable eta*lambda (Adam-style momentum on a quadratic)"))
    figure = Path(args.figure) if args.figure else FIGURE
    plot(rows, figure)
    payload = {"command": "PYTHONPATH=. python bench/delay_stability.py", "rows": rows,
               "figures": [figure_entry(figure)]}
    path = write_results("delay_stability", payload,
                         Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path} and {figure}")
    return payload


if __name__ == "__main__":
    main()

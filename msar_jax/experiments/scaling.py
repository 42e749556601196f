"""Scaling law (the MSAR paper §4.3, Eq. 18, Appendix B) over the four-rung ladder, one command.

    python -m msar_jax.experiments.scaling --workdir=runs/scaling --train      # train the ladder, then fit
    python -m msar_jax.experiments.scaling --workdir=runs/scaling              # fit the finished runs
    python -m msar_jax.experiments.scaling --results=points.json --out=DIR     # fit given points
    python -m msar_jax.experiments.scaling --workdir=W --E=0.72                # a fixed E instead of the rule
    python -m msar_jax.experiments.scaling --workdir=W --train --token_scale=0.2  # 1/5 of every budget

Trains Vanilla, mHC, AttnRes and MSAR at each rung with matched token budgets, fits
``L(C) = A C^-beta + E`` with E shared (by default chosen by profile likelihood, ``profile_E``) and
reports the iso-loss compute speedups over Vanilla. Compute, loss, fit and outputs: docs/methods.md §2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from msar_jax.cli import non_negative_int, positive_int, run_cli, shard

METHODS: dict[str, tuple[str, str]] = {
    "vanilla": ("configs/scaling/vanilla.py", "Vanilla"),
    "mhc": ("configs/scaling/mhc.py", "mHC"),
    "attnres": ("configs/scaling/attnres.py", "AttnRes"),
    "msar": ("configs/scaling/msar.py", "MSAR"),
}
RUNGS = ("ladder_1", "ladder_2", "ladder_3", "ladder_4")
PAPER_SPEEDUPS = {"msar": 1.58, "attnres": 1.35, "mhc": 1.30}
PAPER_E = 0.72
LOG2_10 = math.log2(10.0)


# --------------------------------------------------------------------------------------------
# Fitting (Appendix B)
# --------------------------------------------------------------------------------------------


def fit_power_law(C, loss, E: float) -> dict:
    """OLS of ``log2(L - E)`` on ``log10(C)``: ``{"A", "beta", "E", "slope", "intercept", "rss", "residuals"}``."""
    C = np.asarray(C, np.float64)
    loss = np.asarray(loss, np.float64)
    if np.any(loss <= E):
        raise ValueError(f"every loss must exceed E = {E}; min loss {loss.min()}")
    if C.size < 2:
        raise ValueError("need at least two points to fit a power law")
    x = np.log10(C)
    y = np.log2(loss - E)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    return {"A": float(2.0 ** intercept), "beta": float(-slope / LOG2_10), "E": float(E), "slope": float(slope),
            "intercept": float(intercept), "rss": float(np.sum(resid ** 2)), "residuals": resid.tolist()}


def predict(fit: dict, C) -> np.ndarray:
    return fit["A"] * np.asarray(C, np.float64) ** (-fit["beta"]) + fit["E"]


def compute_for_loss(fit: dict, loss) -> np.ndarray:
    """``C(L) = ((L - E) / A)^(-1/beta)``: the compute at which the fitted curve reaches ``loss``."""
    return ((np.asarray(loss, np.float64) - fit["E"]) / fit["A"]) ** (-1.0 / fit["beta"])


def iso_loss_speedups(fit_vanilla: dict, C, loss) -> dict:
    """``C_V(L_{M,k}) / C_{M,k}`` per point and their arithmetic mean."""
    per = compute_for_loss(fit_vanilla, loss) / np.asarray(C, np.float64)
    return {"per_scale": per.tolist(), "mean": float(np.mean(per))}


# Profile likelihood of the shared E (linear loss space). With Gaussian noise of one variance on
# the losses, the likelihood of L = A_M C^-beta_M + E is maximised by the least-squares fit in
# linear space; for a fixed E each method's A is linear (closed form) and beta is one-dimensional,
# so the profile RSS(E) is cheap to evaluate on a grid. The old rule compared log2(L - E)
# residuals across different E; log(L - E) stretches as E -> min L and the comparison favoured
# small E (true E = 0.72, noise 0.01: median 0.57, E = 0 in 22% of draws).
BETA_GRID = np.geomspace(1e-3, 4.0, 160)
BETA_FINE_GRID = np.geomspace(1e-3, 4.0, 1600)
E_GRID_POINTS = 240
BOOTSTRAP_REPLICATES = 400


def _rss_given_E(C, Y, betas):
    """Least-squares RSS of ``Y - A C^-beta`` (A >= 0 in closed form) for every beta.

    ``C``: (n,); ``Y``: (..., n) targets ``L - E``; ``betas``: (k,). Returns (..., k).
    """
    X = np.asarray(C, np.float64)[None, :] ** (-np.asarray(betas, np.float64)[:, None])  # (k, n)
    xy = np.einsum("...n,kn->...k", Y, X)
    A = np.maximum(xy / np.sum(X * X, axis=1), 0.0)
    return np.sum(Y * Y, axis=-1)[..., None] - 2 * A * xy + A * A * np.sum(X * X, axis=1)


def _profile_rss(points: list[tuple], losses: list[np.ndarray], E_grid: np.ndarray,
                 betas: np.ndarray = BETA_GRID) -> np.ndarray:
    """Total over methods of min over (A, beta) of the linear-space RSS, per E of ``E_grid``.

    ``losses[j]``: (B, n_j) for a batch of B data sets (a bootstrap); returns (B, len(E_grid)).
    With ``Y = L - E`` the sums the fit needs are linear / quadratic in E, so they are formed once
    per data set and beta and expanded over the E grid without an (n)-long axis.
    """
    total = 0.0
    E = np.asarray(E_grid, np.float64)[None, :, None]  # (1, nE, 1)
    for (C, _), L in zip(points, losses):
        X = np.asarray(C, np.float64)[None, :] ** (-betas[:, None])  # (k, n)
        xx = np.sum(X * X, axis=1)  # (k,)
        xL = L @ X.T  # (B, k)
        xy = xL[:, None, :] - E * np.sum(X, axis=1)  # (B, nE, k)
        yy = (np.sum(L * L, axis=1)[:, None] - 2 * E[..., 0] * np.sum(L, axis=1)[:, None]
              + L.shape[1] * E[..., 0] ** 2)  # (B, nE)
        A = np.maximum(xy / xx, 0.0)
        total = total + yy + _parabolic_min(A * (A * xx - 2 * xy))
    return total


def _parabolic_min(values: np.ndarray) -> np.ndarray:
    """Minimum over the last axis, sharpened by the vertex of the parabola through the grid minimum and
    its neighbours (the grid is uniform in log beta; without this the grid step biases E)."""
    j = np.clip(np.argmin(values, axis=-1), 1, values.shape[-1] - 2)[..., None]
    y0, y1, y2 = (np.take_along_axis(values, j + o, axis=-1)[..., 0] for o in (-1, 0, 1))
    curvature = y0 - 2 * y1 + y2
    vertex = y1 - np.where(curvature > 0, (y0 - y2) ** 2 / (8 * np.where(curvature > 0, curvature, 1.0)), 0.0)
    return np.minimum(np.min(values, axis=-1), vertex)


def linear_fit(C, loss, E: float) -> dict:
    """``L = A C^-beta + E`` by least squares in linear loss space at a fixed E: ``{"A", "beta", "rss"}``."""
    from scipy.optimize import minimize_scalar

    C = np.asarray(C, np.float64)
    y = np.asarray(loss, np.float64) - E
    rss = _rss_given_E(C, y, BETA_GRID)
    k = int(np.argmin(rss))
    lo, hi = BETA_GRID[max(k - 1, 0)], BETA_GRID[min(k + 1, len(BETA_GRID) - 1)]

    def f(beta):
        return float(_rss_given_E(C, y, np.array([beta]))[0])

    best = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-10})
    beta = float(best.x) if best.fun <= rss[k] else float(BETA_GRID[k])
    x = C ** -beta
    A = max(float(x @ y / (x @ x)), 0.0)
    return {"A": A, "beta": beta, "rss": float(np.sum((y - A * x) ** 2))}


def _refine_E(points, losses, lo: float, hi: float) -> tuple[float, float]:
    """The profile's minimum on ``[lo, hi]``: 65 E values against a 10x finer beta grid (steps of
    0.5%), then the vertex of the parabola through the best point and its neighbours."""
    E_fine = np.linspace(lo, hi, 65)
    prof = _profile_rss(points, losses, E_fine, BETA_FINE_GRID)[0]
    j = int(np.argmin(prof))
    if 0 < j < len(E_fine) - 1:
        y0, y1, y2 = prof[j - 1], prof[j], prof[j + 1]
        curvature = y0 - 2 * y1 + y2
        if curvature > 0:
            h = E_fine[1] - E_fine[0]
            return float(E_fine[j] + 0.5 * h * (y0 - y2) / curvature), float(y1)
    return float(E_fine[j]), float(prof[j])


def profile_E(points: dict[str, tuple], grid: int = E_GRID_POINTS, bootstrap: int = BOOTSTRAP_REPLICATES,
              seed: int = 0, level: float = 0.95) -> dict:
    """Shared E by profile likelihood in linear loss space, with a residual-bootstrap interval.

    ``points``: ``{method: (C, loss)}``. For every E on a grid over ``[0, (1 - 1e-3) min L)`` each
    method's ``A, beta`` are fitted by least squares of ``L - E - A C^-beta``; the E with the least
    total residual sum of squares wins, refined on a finer grid over four grid steps each side
    (``_refine_E``). Interval: residual bootstrap (``bootstrap`` replicates, ``numpy`` generator seeded
    with ``seed``): the pooled residuals, inflated by ``sqrt(n / (n - p))`` for the ``p = 2M + 1``
    fitted parameters, are resampled onto the fitted curves and E is re-profiled on the grid; the
    interval is the replicates' ``(1 - level)/2`` and ``(1 + level)/2`` quantiles.

    Returns ``{"E", "rss", "boundary", "interval", "method", "fits_linear", "bootstrap"}``; the
    ``boundary`` flag is set when the optimum is the grid's first or last point (E not determined
    by the data; pass a fixed ``--E``).
    """
    names = list(points)
    pts = [(np.asarray(c, np.float64), np.asarray(l, np.float64)) for c, l in points.values()]
    n = sum(len(c) for c, _ in pts)
    n_params = 2 * len(pts) + 1
    if max(len(c) for c, _ in pts) < 3 or n <= n_params:
        # two points per method are fitted exactly by any E: the profile is flat
        raise ValueError(f"the shared-E profile needs >= 3 points (scales) for some method and more points ({n}) "
                         f"than fitted parameters ({n_params}); pass a fixed --E")
    min_loss = min(float(np.min(l)) for _, l in pts)
    hi = (1.0 - 1e-3) * min_loss
    E_grid = np.linspace(0.0, hi, grid)
    prof = _profile_rss(pts, [l[None, :] for _, l in pts], E_grid)[0]
    k = int(np.argmin(prof))
    # the grid's beta steps (5%) can move the grid optimum by a few E steps: refine over +-4 of them
    E_hat, _ = _refine_E(pts, [l[None, :] for _, l in pts], E_grid[max(k - 4, 0)], E_grid[min(k + 4, grid - 1)])
    fits = {m: linear_fit(c, l, E_hat) for m, (c, l) in zip(names, pts)}
    rss = sum(f["rss"] for f in fits.values())
    out = {"E": E_hat, "rss": rss, "boundary": bool(k == 0 or k == grid - 1), "interval": [0.0, float(hi)],
           "method": "profile likelihood, linear loss space (least squares of L - E - A C^-beta)",
           "fits_linear": fits}
    if bootstrap:
        fitted = [fits[m]["A"] * c ** -fits[m]["beta"] + E_hat for m, (c, _) in zip(names, pts)]
        resid = np.concatenate([l - f for (_, l), f in zip(pts, fitted)]) * math.sqrt(n / (n - n_params))
        resid -= resid.mean()
        rng = np.random.default_rng(seed)
        draws = rng.choice(resid, size=(bootstrap, n), replace=True)
        boot_losses, start = [], 0
        for f in fitted:
            boot_losses.append(f[None, :] + draws[:, start:start + len(f)])
            start += len(f)
        # a replicate's E grid must stay below its own smallest loss
        boot_min = np.min(np.concatenate(boot_losses, axis=1), axis=1)
        E_boot = np.empty(bootstrap)
        for b0 in range(0, bootstrap, 100):  # chunks bound the (B, nE, n_beta, n) temporaries
            sl = slice(b0, min(b0 + 100, bootstrap))
            prof_b = _profile_rss(pts, [bl[sl] for bl in boot_losses], E_grid)
            prof_b[E_grid[None, :] >= (1.0 - 1e-3) * boot_min[sl, None]] = np.inf
            E_boot[sl] = E_grid[np.argmin(prof_b, axis=1)]
        q = np.quantile(E_boot, [(1 - level) / 2, (1 + level) / 2])
        out["bootstrap"] = {"replicates": int(bootstrap), "seed": int(seed), "level": level,
                            "E_interval": [float(q[0]), float(q[1])], "E_median": float(np.median(E_boot)),
                            "at_zero": float(np.mean(E_boot == 0.0)),
                            "kind": "residual bootstrap, pooled residuals scaled by sqrt(n/(n-p)), E re-profiled on "
                                    f"the {grid}-point grid"}
    return out


def fit_all(points: dict[str, tuple], E: float | str = "profile", bootstrap: int = BOOTSTRAP_REPLICATES,
            seed: int = 0) -> dict:
    """Fit every method with a shared E (a float, or ``"profile"``) and the speedups over Vanilla.

    With ``"profile"`` E comes from ``profile_E`` (linear-space profile likelihood, bootstrap
    interval); A and beta are then fitted by the paper's log-space OLS at that E (Appendix B), so
    only the choice of E differs from the fixed-E mode.
    """
    if isinstance(E, str):
        if E != "profile":
            raise ValueError(f"E must be a float or 'profile'; got {E!r}")
        prof = profile_E(points, bootstrap=bootstrap, seed=seed)
        E_value, how = prof["E"], {"rule": "profile", **prof}
    else:
        E_value, how = float(E), {"rule": "fixed", "E": float(E)}
    fits = {name: fit_power_law(c, l, E_value) for name, (c, l) in points.items()}
    out = {"E": E_value, "E_choice": how, "fits": fits, "speedups": {}}
    if "vanilla" in fits:
        for name, (c, l) in points.items():
            out["speedups"][name] = iso_loss_speedups(fits["vanilla"], c, l)
    return out


# --------------------------------------------------------------------------------------------
# Points from runs
# --------------------------------------------------------------------------------------------


def scale_token_budget(config, fraction: float, overrides: dict | None = None):
    """``config`` trained on ``fraction`` of its token budget: ``train.steps``, the warmup, the eval and
    the checkpoint intervals are scaled alike (each at least 1), batch and sequence length kept, so
    the budgets stay matched across methods at a rung. Explicit ``overrides`` still win."""
    if not (fraction > 0 and math.isfinite(fraction)):
        raise ValueError(f"token_scale={fraction}: must be a positive finite fraction")
    steps = max(1, round(int(config.train.steps) * fraction))
    with config.unlocked():
        config.train.steps = steps
        config.optim.warmup_steps = min(steps, max(1, round(int(config.optim.warmup_steps) * fraction)))
        config.train.eval_every = min(steps, max(1, round(int(config.train.eval_every) * fraction)))
        if int(config.checkpoint.every) > 0:
            config.checkpoint.every = min(steps, max(1, round(int(config.checkpoint.every) * fraction)))
    for key, value in (overrides or {}).items():
        config.update_from_flattened_dict({key: value})
    return config


def collect_points(workdir, methods=METHODS, rungs=RUNGS, loss: str = "val") -> list[dict]:
    """``[{"method", "rung", "loss", "flops", "tokens"}]`` of the finished runs in ``workdir``."""
    from msar_jax.experiments.ablation import read_final

    key = {"val": "val_loss", "train": "final_train_loss"}[loss]
    pts = []
    for m in methods:
        for r in rungs:
            final = read_final(Path(workdir) / m / r)
            if final and final.get("finished") and final.get(key) is not None:
                per_token = final["accounting"]["flops_per_token_train_excl_lm_head"]
                pts.append({"method": m, "rung": r, "loss": float(final[key]), "tokens": int(final["tokens"]),
                            "flops": float(per_token) * int(final["tokens"]),
                            "tokens_per_s": final.get("tokens_per_s")})
    return pts


def normalise(points: list[dict]) -> tuple[dict[str, tuple], float, str]:
    """``{method: (C, loss)}`` with C = flops / Vanilla's flops at its largest rung (or the given C)."""
    if all("C" in p for p in points):
        ref, ref_rung = 1.0, "given"
    else:
        van = [p for p in points if p["method"] == "vanilla"]
        if not van:
            raise ValueError("normalising compute needs Vanilla runs (or give C directly)")
        top = max(van, key=lambda p: p["flops"])
        ref, ref_rung = top["flops"], top.get("rung", "?")
    by: dict[str, list] = {}
    for p in points:
        c = p["C"] if "C" in p else p["flops"] / ref
        by.setdefault(p["method"], []).append((c, p["loss"]))
    out = {}
    for m, rows in by.items():
        rows.sort()
        out[m] = (np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))
    return out, ref, ref_rung


# --------------------------------------------------------------------------------------------
# Report and plot
# --------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    how = report["E_choice"]
    boot = how.get("bootstrap")
    rule = how["rule"] + (" likelihood in linear loss space" if how["rule"] == "profile" else "")
    if boot:
        rule += (f"; {100 * boot['level']:.0f}% residual-bootstrap interval {boot['E_interval'][0]:.3f} to "
                 f"{boot['E_interval'][1]:.3f} over {boot['replicates']} replicates, seed {boot['seed']}")
    lines = [f"Scaling law (Eq. 18): L(C) = A C^-beta + E, E = {report['E']:.4f} shared and fixed "
             f"({rule}" + (", at the boundary of its interval: E is not determined by "
                           "these data" if how.get("boundary") else "")
             + f"); C normalised by Vanilla's training FLOPs (excl. LM head) at {report['reference']['rung']} "
             f"= {report['reference']['flops']:.4g}. Loss: {report['loss']}.", "",
             "| Method | A | beta | points (C, L) | speedup per scale | mean speedup | paper |",
             "|---|---|---|---|---|---|---|"]
    for m, fit in report["fits"].items():
        pts = report["points_by_method"][m]
        sp = report["speedups"].get(m)
        lines.append(
            f"| {METHODS.get(m, (None, m))[1]} | {fit['A']:.4g} | {fit['beta']:.4g} | "
            + ", ".join(f"({c:.3g}, {l:.4f})" for c, l in zip(pts["C"], pts["loss"]))
            + f" | {', '.join(f'{s:.3f}' for s in sp['per_scale']) if sp else '-'} | "
            f"{sp['mean']:.3f}x | {PAPER_SPEEDUPS.get(m, 1.0) if m != 'vanilla' else 1.0:.2f}x |"
            if sp else f"| {m} | {fit['A']:.4g} | {fit['beta']:.4g} | - | - | - | - |")
    deltas = report.get("rung_deltas") or {}
    if deltas:
        methods = [m for m in METHODS if any(m in d for d in deltas.values())]
        lines += ["", "Loss minus Vanilla's at each rung (matched tokens and backbone; needs neither E nor the fit):", "",
                  "| rung | " + " | ".join(METHODS[m][1] for m in methods) + " |",
                  "|---|" + "---|" * len(methods)]
        for r in sorted(deltas):
            lines.append(f"| {r} | " + " | ".join(f"{deltas[r][m]:+.4f}" if m in deltas[r] else "-" for m in methods) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.6))
    colors = {"vanilla": "tab:gray", "mhc": "tab:green", "attnres": "tab:blue", "msar": "tab:red"}
    allc = np.concatenate([np.asarray(p["C"]) for p in report["points_by_method"].values()])
    xs = np.geomspace(allc.min() / 1.5, allc.max() * 1.5, 200)
    for m, fit in report["fits"].items():
        pts = report["points_by_method"][m]
        col = colors.get(m)
        label = METHODS.get(m, (None, m))[1]
        sp = report["speedups"].get(m)
        if sp and m != "vanilla":
            label += f" ({sp['mean']:.2f}x)"
        ax.plot(pts["C"], pts["loss"], "o", color=col)
        ax.plot(xs, predict(fit, xs), "-", color=col, lw=1.2,
                label=f"{label}: {fit['A']:.3g} C^-{fit['beta']:.3g} + {fit['E']:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("normalised training compute C (excl. LM head; 1 = Vanilla at the largest scale)")
    ax.set_ylabel(f"final loss ({report['loss']})")
    ax.set_title(f"Scaling law, E = {report['E']:.3f} ({report['E_choice']['rule']})", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


def rung_deltas(points: list[dict]) -> dict[str, dict[str, float]]:
    """``{rung: {method: loss - Vanilla's loss}}`` at every rung that has a Vanilla run: the
    comparison at matched tokens and backbone, which needs neither E nor a fit."""
    by_rung: dict[str, dict[str, float]] = {}
    for p in points:
        if p.get("rung") is not None:
            by_rung.setdefault(p["rung"], {})[p["method"]] = float(p["loss"])
    return {r: {m: v - losses["vanilla"] for m, v in losses.items()}
            for r, losses in by_rung.items() if "vanilla" in losses}


def report_from_points(points: list[dict], E: float | str = "profile", loss: str = "val",
                       bootstrap: int = BOOTSTRAP_REPLICATES, seed: int = 0) -> dict:
    by, ref, ref_rung = normalise(points)
    res = fit_all(by, E, bootstrap=bootstrap, seed=seed)
    return {**res, "rung_deltas": rung_deltas(points),
            "loss": {"val": "final validation loss", "train": "final training loss"}.get(loss, loss),
            "reference": {"flops": ref, "rung": ref_rung}, "points": points,
            "points_by_method": {m: {"C": c.tolist(), "loss": l.tolist()} for m, (c, l) in by.items()},
            "paper": {"E": PAPER_E, "speedups": PAPER_SPEEDUPS}}


def write_report(report: dict, out_dir) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "scaling_results.json", "md": out_dir / "scaling.md", "png": out_dir / "scaling.png"}
    paths["json"].write_text(json.dumps(report, indent=2), encoding="utf-8")
    paths["md"].write_text(markdown(report), encoding="utf-8")
    plot(report, paths["png"])
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msar_jax.experiments.scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=None, help="runs in W/<method>/<rung>/ (trained there with --train)")
    ap.add_argument("--results", default=None,
                    help='JSON: a list of {"method", "loss", "flops" | "C" [, "rung"]} (or a scaling_results.json)')
    ap.add_argument("--out", default=None, help="output folder (default: the workdir)")
    ap.add_argument("--train", action="store_true", help="train the missing / unfinished runs first")
    ap.add_argument("--methods", default="all", help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--rungs", default="all", help=f"comma-separated subset of {','.join(RUNGS)}")
    ap.add_argument("--steps", type=positive_int, default=None, help="override train.steps at every rung (smoke)")
    ap.add_argument("--token_scale", type=float, default=None,
                    help="train every rung for this fraction of its token budget (steps, warmup, eval and "
                         "checkpoint intervals scaled alike; budgets stay matched across methods)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--seed", type=non_negative_int, default=0)
    ap.add_argument("--shard", type=shard, default=(0, 1), help="i/n: train only the i-th of every n runs")
    ap.add_argument("--loss", choices=("val", "train"), default="val")
    ap.add_argument("--E", default="profile", help="'profile' (shared-E rule, see above) or a fixed float")
    args = ap.parse_args(argv)
    try:
        E = args.E if args.E == "profile" else float(args.E)
    except ValueError:
        ap.error(f"--E={args.E!r}: must be 'profile' or a number")
    if args.token_scale is not None and not (args.token_scale > 0 and math.isfinite(args.token_scale)):
        ap.error(f"--token_scale={args.token_scale}: must be a positive finite fraction of each rung's budget")
    if args.token_scale is not None and args.steps is not None:
        ap.error("--token_scale and --steps both set the step count: give one")
    methods = list(METHODS) if args.methods == "all" else args.methods.split(",")
    rungs = list(RUNGS) if args.rungs == "all" else args.rungs.split(",")
    for flag, given, known in (("--methods", methods, METHODS), ("--rungs", rungs, RUNGS)):
        if set(given) - set(known):
            ap.error(f"{flag}={','.join(given)}: unknown {sorted(set(given) - set(known))}; known: {','.join(known)}")
    if args.results:
        raw = json.loads(Path(args.results).read_text(encoding="utf-8"))
        points = raw["points"] if isinstance(raw, dict) else raw
        out_dir = args.out or Path(args.results).parent
    else:
        if not args.workdir:
            ap.error("give --workdir (runs) or --results (points)")
        if args.train:
            from absl import logging as absl_logging

            from msar_jax.experiments.ablation import build_config, parse_overrides, run_one

            absl_logging.set_verbosity(absl_logging.WARNING)
            overrides = parse_overrides(args.set)
            shard_i, shard_n = args.shard
            pairs = [(m, r) for r in rungs for m in methods]
            for k, (m, r) in enumerate(pairs):
                if k % shard_n == shard_i:
                    spec = f"{METHODS[m][0]}:size={r}"
                    config = build_config(spec, args.seed, args.steps, overrides)
                    if args.token_scale is not None:
                        config = scale_token_budget(config, args.token_scale, overrides)
                    res = run_one(config, Path(args.workdir) / m / r, label=f"{m} {r} [{spec}]")
                    if res["status"] == "stopped":  # SIGTERM / SIGINT: saved; rerun to resume
                        return 1
        points = collect_points(args.workdir, methods, rungs, args.loss)
        out_dir = args.out or args.workdir
    if not points:
        print("no finished runs / points to fit", file=sys.stderr)
        return 1
    try:
        report = report_from_points(points, E, args.loss)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = write_report(report, out_dir)
    print(markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))  # a config error (--set, a rung's config): one line, exit status 1

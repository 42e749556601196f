"""Scaling law (seed 000 §4.3 Eq. 18, Appendix B) over the four-rung ladder, one command.

    python -m msar_jax.experiments.scaling --workdir=runs/scaling --train      # train the ladder, then fit
    python -m msar_jax.experiments.scaling --workdir=runs/scaling              # fit the finished runs
    python -m msar_jax.experiments.scaling --results=points.json --out=DIR     # fit given points
    python -m msar_jax.experiments.scaling --workdir=W --E=0.72                # a fixed E instead of the rule
    python -m msar_jax.experiments.scaling --workdir=W --train --token_scale=0.2  # 1/5 of every budget

Runs: ``METHODS`` (Vanilla, mHC, AttnRes, MSAR; ``configs/scaling/<method>.py``) x ``RUNGS``
(``ladder_1..ladder_4``: Table 4's depths and layers per block at ~8x smaller width,
configs/common.py), each in ``W/<method>/<rung>/`` with the same skip-finished / resume rule as
the ablation command (``final.json``); every method gets the same backbone and token budget
(``train.steps x batch_size x seq_len``) at a rung (Appendix B "matched training-token budgets").

Compute (§4.3): ``C = tokens x training FLOPs per token`` from ``msar_jax.accounting`` **excluding
the LM head and including the mechanism's overhead** (``flops.train.model_excl_lm_head``),
normalised by Vanilla's value at the largest rung (the same reference for every method).

Loss: the final validation loss of each run (``--loss=val``, default). The paper fits the final
*training* loss; its runs see every token once, ours repeat the small bundled corpus many times,
where training loss measures memorisation. ``--loss=train`` (mean of the last 10 logged training
losses) is available.

Fit (Appendix B, exactly): ``L(C) = A C^-beta + E`` per method with E shared and fixed; ordinary
least squares of ``log2(L - E)`` on ``log10(C)``; ``beta = -slope / log2(10)``,
``A = 2^intercept``. Iso-loss compute speedup of method M over Vanilla at rung k:
``C_V(L_{M,k}) / C_{M,k}`` with ``C_V(L) = ((L - E) / A_V)^(-1/beta_V)``, averaged
(arithmetic mean) over the rungs.

Choosing E for this corpus. The paper's E = 0.72 is an estimate of the irreducible loss of its
data (nats per Qwen2 token on its corpus); it means nothing for byte-level loss on the bundled
corpus. Rule used here (``--E=profile``, default): E is **one value shared by all methods**,
chosen by profiling - for every candidate E on a grid over ``[0, (1 - 1e-3) min L)`` (min over all
runs), fit each method's OLS line as above and add up the residual sums of squares of
``log2(L - E)``; take the E with the smallest total (then refined by golden-section search
between the neighbouring grid points). That E is then held fixed for every method, as in the
paper. If the optimum sits on the boundary of the interval (E = 0 or E -> min L: the data do not
determine E), the report says so; then pass a fixed value with ``--E=<float>``. With fewer than
three rungs per method every E fits exactly, so the rule refuses and asks for a fixed E. With exact
power-law data the profile recovers the true E (tests).

Outputs (``--out``, default the workdir): ``scaling_results.json`` (points, E and how it was
chosen, per-method A, beta, slope, intercept, residuals, per-rung speedups and their mean, the
paper's speedups), ``scaling.md`` and ``scaling.png`` (loss against normalised compute on log
axes, points and fitted curves).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

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


def profile_E(points: dict[str, tuple], grid: int = 2000) -> dict:
    """Shared E minimising the total OLS residual sum of squares of every method's fit.

    ``points``: ``{method: (C, loss)}``. Returns ``{"E", "rss", "boundary", "interval"}``.
    """
    if max(len(c) for c, _ in points.values()) < 3:
        # two points per method are fitted exactly by any E: the profile is flat
        raise ValueError("the shared-E profile needs >= 3 points (scales) for some method; pass a fixed --E")
    min_loss = min(float(np.min(l)) for _, l in points.values())
    hi = (1.0 - 1e-3) * min_loss

    def total(E):
        return sum(fit_power_law(c, l, E)["rss"] for c, l in points.values())

    es = np.linspace(0.0, hi, grid)
    vals = np.array([total(e) for e in es])
    k = int(np.argmin(vals))
    lo_e, hi_e = es[max(k - 1, 0)], es[min(k + 1, grid - 1)]
    g = (math.sqrt(5) - 1) / 2  # golden-section refinement on the bracketing interval
    a, b = lo_e, hi_e
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = total(c), total(d)
    for _ in range(80):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = total(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = total(d)
    best = min(((vals[k], es[k]), (fc, c), (fd, d)))
    boundary = k == 0 or k == grid - 1
    return {"E": float(best[1]), "rss": float(best[0]), "boundary": bool(boundary), "interval": [0.0, float(hi)]}


def fit_all(points: dict[str, tuple], E: float | str = "profile") -> dict:
    """Fit every method with a shared E (a float, or ``"profile"``) and the speedups over Vanilla."""
    if isinstance(E, str):
        if E != "profile":
            raise ValueError(f"E must be a float or 'profile'; got {E!r}")
        prof = profile_E(points)
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
                            "flops": float(per_token) * int(final["tokens"])})
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
    lines = [f"Scaling law (Eq. 18): L(C) = A C^-beta + E, E = {report['E']:.4f} shared and fixed "
             f"({report['E_choice']['rule']}" + (", at the boundary of its interval: E is not determined by "
                                                  "these data" if report["E_choice"].get("boundary") else "")
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


def report_from_points(points: list[dict], E: float | str = "profile", loss: str = "val") -> dict:
    by, ref, ref_rung = normalise(points)
    res = fit_all(by, E)
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
    ap.add_argument("--steps", type=int, default=None, help="override train.steps at every rung (smoke)")
    ap.add_argument("--token_scale", type=float, default=None,
                    help="train every rung for this fraction of its token budget (steps, warmup, eval and "
                         "checkpoint intervals scaled alike; budgets stay matched across methods)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default="0/1", help="i/n: train only the i-th of every n runs")
    ap.add_argument("--loss", choices=("val", "train"), default="val")
    ap.add_argument("--E", default="profile", help="'profile' (shared-E rule, see above) or a fixed float")
    args = ap.parse_args(argv)
    E = args.E if args.E == "profile" else float(args.E)
    if args.token_scale is not None and not (args.token_scale > 0 and math.isfinite(args.token_scale)):
        ap.error(f"--token_scale={args.token_scale}: must be a positive finite fraction of each rung's budget")
    if args.token_scale is not None and args.steps is not None:
        ap.error("--token_scale and --steps both set the step count: give one")
    methods = list(METHODS) if args.methods == "all" else args.methods.split(",")
    rungs = list(RUNGS) if args.rungs == "all" else args.rungs.split(",")
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
            shard_i, shard_n = (int(x) for x in args.shard.split("/"))
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
    sys.exit(main())

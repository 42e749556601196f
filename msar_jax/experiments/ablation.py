"""Table 2 (the MSAR paper §4.4): every ablation row, several seeds, one command.

    python -m msar_jax.experiments.ablation --size=small --seeds=3 --workdir=runs/ablation_small
    python -m msar_jax.experiments.ablation --size=small --seeds=3 --workdir=W --rows=vanilla,attnres,msar
    python -m msar_jax.experiments.ablation --size=tiny --seeds=2 --rows=vanilla,msar --steps=3 --workdir=/tmp/abl
    python -m msar_jax.experiments.ablation --workdir=W --report_only      # aggregate what is there

Each (row, seed) trains in ``W/<row>/seed<k>/`` (finished runs skipped, others resumed; ``--shard=i/n``
splits the work), and the final validation losses are compared paired by seed with t intervals in
``results.json``, ``table.md`` and the figures. Procedure and statistics: docs/methods.md §1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from msar_jax.cli import non_negative_int, positive_int, run_cli, shard

FINAL_NAME = "final.json"

# name -> (config file, Table 2 label, paper Pile loss)
ROWS: dict[str, tuple[str, str, float]] = {
    "vanilla": ("configs/vanilla.py", "Vanilla", 1.898),
    "mhc": ("configs/mhc.py", "mHC", 1.871),
    "attnres": ("configs/attnres.py", "AttnRes", 1.867),
    "attnres_mhc": ("configs/attnres_mhc.py", "AttnRes + mHC", 1.861),
    "msar": ("configs/msar.py", "MSAR (default)", 1.847),
    "no_conv": ("configs/ablations/no_conv.py", "w/o Conv", 1.862),
    "mean_fusion": ("configs/ablations/mean_fusion.py", "w/o H_pre (mean)", 1.851),
    "m2": ("configs/ablations/m2.py", "m = 2", 1.850),
    "m8": ("configs/ablations/m8.py", "m = 8", 1.846),
    "full": ("configs/ablations/full.py", "Full MSAR (S = 1)", 1.843),
    "s2": ("configs/ablations/s2.py", "S = 2", 1.845),
    "s8": ("configs/ablations/s8.py", "S = 8", 1.852),
}
# every row is compared, paired by seed, with Vanilla, AttnRes and the default MSAR (the ablations'
# own reference: Table 2's "w/o Conv", m, S rows each change one thing in it)
REFERENCES = ("vanilla", "attnres", "msar")


# --------------------------------------------------------------------------------------------
# One run: skip if finished, else train (the loop resumes from the run's checkpoint)
# --------------------------------------------------------------------------------------------


def parse_overrides(items) -> dict:
    """``--set KEY=VALUE`` items -> overrides (``msar_jax.config.parse_overrides``); a malformed
    item ends the command with its message."""
    from msar_jax import config as config_lib

    try:
        return config_lib.parse_overrides(items)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None


def build_config(spec: str, seed: int, steps: int | None = None, overrides: dict | None = None, quiet: bool = True):
    """``load_config(spec)`` with ``train.seed`` and optionally ``train.steps`` set (warmup clipped)."""
    from msar_jax.config import load_config

    over = {"train.seed": int(seed)}
    if quiet:
        over["train.progress"] = False
    config = load_config(spec, {**over, **(overrides or {})})
    if steps is not None:
        with config.unlocked():
            config.train.steps = int(steps)
            config.optim.warmup_steps = min(int(config.optim.warmup_steps), int(steps))
    for key, value in (overrides or {}).items():  # explicit overrides win over the clipping
        config.update_from_flattened_dict({key: value})
    return config


def read_final(run_dir) -> dict | None:
    path = Path(run_dir) / FINAL_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def is_finished(run_dir, steps: int | None = None) -> bool:
    final = read_final(run_dir)
    if not final or not final.get("finished"):
        return False
    return steps is None or int(final.get("step", -1)) == int(steps)


def _median_tokens_per_s(run_dir) -> float | None:
    from msar_jax.train.metrics import read_jsonl

    try:
        recs = read_jsonl(run_dir, "train")
    except OSError:
        return None
    vals = [r["tokens_per_s"] for r in recs if r["step"] > 1 and isinstance(r.get("tokens_per_s"), (int, float))
            and math.isfinite(r["tokens_per_s"])]
    return float(np.median(vals)) if vals else None


def _final_train_loss(run_dir, window: int = 10) -> float | None:
    from msar_jax.train.metrics import read_jsonl

    try:
        recs = [r for r in read_jsonl(run_dir, "train") if isinstance(r.get("loss"), (int, float))]
    except OSError:
        return None
    return float(np.mean([r["loss"] for r in recs[-window:]])) if recs else None


def accounting_summary(config) -> dict:
    from msar_jax import accounting

    rep = accounting.account(config)
    p, f = rep["params"], rep["flops"]
    return {
        "residual_params": int(p["residual"]),
        "residual_params_pct": float(p["residual_pct_of_vanilla_activated"]),
        "params_total": int(p["total"]),
        "flops_per_token_train": float(f["train"]["model_total"]),
        "flops_per_token_train_excl_lm_head": float(f["train"]["model_excl_lm_head"]),
        "flops_overhead_pct_incl_lm_head": float(f["overhead_pct_incl_lm_head"]),
        "flops_overhead_pct_excl_lm_head": float(f["overhead_pct_excl_lm_head"]),
        "streams": int(rep["dims"]["streams"]),
        "block_size": int(rep["dims"]["block_size"]),
        "n_blocks": int(rep["dims"]["n_blocks"]),
    }


def run_one(config, run_dir, *, label: str = "", train_fn=None, log=print) -> dict:
    """Train ``config`` in ``run_dir`` unless finished; return ``final.json``'s content plus ``status``.

    ``status``: ``"skipped"`` (already finished), ``"trained"``, ``"stopped"`` (SIGTERM / SIGINT:
    not finished, rerun to resume) or ``"failed"`` (the exception is in ``error.txt``).
    """
    run_dir = Path(run_dir)
    steps = int(config.train.steps)
    if is_finished(run_dir, steps):
        return {**read_final(run_dir), "status": "skipped"}
    final = read_final(run_dir)
    if final and final.get("finished"):
        raise SystemExit(f"{run_dir} finished at step {final.get('step')} but {steps} steps were asked for; "
                         "use another workdir (a finished schedule cannot be extended)")
    if train_fn is None:
        from msar_jax.train import train as train_fn
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"[{time.strftime('%H:%M:%S')}] train {label or run_dir} ({steps} steps)")
    try:
        result = train_fn(config, run_dir)
    except Exception as e:  # keep going with the other runs; the error is recorded
        (run_dir / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        log(f"  FAILED: {e!r} (see {run_dir / 'error.txt'})")
        return {"finished": False, "status": "failed", "error": repr(e)}
    if result["stopped"] != "done":
        log(f"  stopped at step {result['step']} ({result['stopped']}); rerun to resume")
        return {"finished": False, "status": "stopped", "step": result["step"]}
    summary = {
        "finished": True,
        "step": int(result["step"]),
        "steps": steps,
        "seed": int(config.train.seed),
        "mechanism": config.model.residual.name,
        "size": config.get("size"),
        "val_loss": result["val_loss"],
        "val_bpb": result["val_bpb"],
        "final_train_loss": _final_train_loss(run_dir),
        "tokens_per_s": _median_tokens_per_s(run_dir),
        "tokens": steps * int(config.train.batch_size) * int(config.seq_len),
        "wall_time_s": result["wall_time_s"],
        "resumed_from": result["resumed_from"],
        "depth_weights": result.get("depth_weights"),
        "accounting": accounting_summary(config),
        "time": time.time(),
    }
    tmp = run_dir / (FINAL_NAME + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2), encoding="utf-8")
    os.replace(tmp, run_dir / FINAL_NAME)  # atomic: a crash never leaves a half-written marker
    (run_dir / "error.txt").unlink(missing_ok=True)
    log(f"  val loss {summary['val_loss']:.4f}  ({summary['wall_time_s']:.0f}s)")
    return {**summary, "status": "trained"}


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def mean_std(values) -> tuple[float | None, float | None]:
    v = np.asarray([x for x in values if x is not None], np.float64)
    if v.size == 0:
        return None, None
    return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else None)


def t_quantile(level: float, df: int) -> float:
    """Two-sided Student-t critical value: ``t_{(1 + level)/2, df}`` (3 seeds: df = 2, 4.303 at 95%)."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, df))


def paired_difference(row: dict[int, float], ref: dict[int, float], level: float = 0.95) -> dict:
    """``row - ref`` over the seeds both have: per-seed values, mean, std, standard error, the paired
    t statistic ``mean / se`` and the ``level`` confidence interval ``mean +- t_{df} se`` from the t
    distribution with ``df = n - 1`` (``None`` below two common seeds)."""
    seeds = sorted(set(row) & set(ref))
    diffs = [row[s] - ref[s] for s in seeds]
    mean, std = mean_std(diffs)
    se = std / math.sqrt(len(diffs)) if std is not None else None
    out = {"seeds": seeds, "per_seed": diffs, "mean": mean, "std": std, "se": se, "n": len(diffs),
           "df": None, "t": None, "t_crit": None, "ci": None, "ci_level": level}
    if se is not None:
        df = len(diffs) - 1
        crit = t_quantile(level, df)
        out.update(df=df, t=(mean / se if se > 0 else None), t_crit=crit, ci=[mean - crit * se, mean + crit * se])
    return out


RUN_FIELDS = ("val_loss", "final_train_loss", "tokens_per_s", "steps", "wall_time_s", "time")


def stored_runs(workdir) -> dict[str, dict[str, dict]]:
    """``{row: {seed: run record}}`` from a previous ``results.json`` in ``workdir``: the compact table
    a results folder keeps once its per-run folders are gone (``results/``)."""
    path = Path(workdir) / "results.json"
    if not path.is_file():
        return {}
    try:
        rows = json.loads(path.read_text(encoding="utf-8")).get("rows", {})
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not readable as the ablation table ({e})") from None
    return {name: {str(k): v for k, v in (r.get("runs") or {}).items()} for name, r in rows.items()}


def aggregate(workdir, rows, seeds, size: str, steps: int | None, overrides: dict | None) -> dict:
    """Read every finished run of ``rows`` x ``seeds`` and build ``results.json``'s content.

    A run is read from ``W/<row>/seed<k>/final.json``; where that folder is absent, from the
    ``runs`` records of an earlier ``W/results.json`` (so the report can be rebuilt from the
    compact table alone). Either way a run whose step count differs from the requested one is
    left out with a warning.
    """
    workdir = Path(workdir)
    stored = stored_runs(workdir)
    out = {"size": size, "steps": steps, "seeds": list(seeds), "overrides": overrides or {},
           "loss": "final validation loss (nats/token)", "rows": {}, "created": time.time()}
    losses: dict[str, dict[int, float]] = {}
    for name in rows:
        spec, label, paper = ROWS[name]
        per_seed, runs, accs = {}, {}, []
        try:
            expected = int(build_config(f"{spec}:size={size}", 0, steps, overrides).train.steps)
        except Exception:
            expected = None
        for seed in seeds:
            run_dir = workdir / name / f"seed{seed}"
            final = read_final(run_dir)
            if final is None and not run_dir.exists():
                final = stored.get(name, {}).get(str(seed))
                final = {**final, "finished": True} if final else None
            if final and final.get("finished"):
                if expected is not None and int(final.get("steps", final.get("step", -1))) != expected:
                    print(f"warning: {run_dir} ran {final.get('steps')} steps, not {expected}; "
                          "left out", file=sys.stderr)
                    continue
                per_seed[seed] = float(final["val_loss"])
                runs[seed] = {k: final.get(k) for k in RUN_FIELDS}
                if final.get("accounting"):
                    accs.append(final["accounting"])
        losses[name] = per_seed
        mean, std = mean_std(per_seed.values())
        acc = accs[0] if accs else None
        if acc is None:
            try:
                acc = accounting_summary(build_config(f"{spec}:size={size}", 0, steps, overrides))
            except Exception:  # informative only
                acc = None
        tps = [r.get("tokens_per_s") for r in runs.values() if r.get("tokens_per_s")]
        out["rows"][name] = {
            "label": label, "config": f"{spec}:size={size}", "paper_loss": paper,
            "paper_diff_vs_vanilla": round(paper - ROWS["vanilla"][2], 3),
            "paper_diff_vs_attnres": round(paper - ROWS["attnres"][2], 3),
            "paper_diff_vs_msar": round(paper - ROWS["msar"][2], 3),
            "n_seeds": len(per_seed), "per_seed": {str(s): v for s, v in per_seed.items()},
            "mean": mean, "std": std,
            "train_loss_mean": mean_std([r.get("final_train_loss") for r in runs.values()])[0],
            "tokens_per_s": float(np.mean(tps)) if tps else None,
            "accounting": acc,
            "runs": {str(s): r for s, r in runs.items()},
        }
    for name in rows:
        for ref in REFERENCES:
            if ref in losses and name != ref:
                out["rows"][name][f"diff_vs_{ref}"] = paired_difference(losses[name], losses[ref])
    return out


def _f(x, spec=".4f", none="-"):
    return none if x is None else format(x, spec)


def _pm(mean, err, spec=".4f"):
    if mean is None:
        return "-"
    return f"{mean:{spec}}" + (f" ± {err:{spec}}" if err is not None else "")


def _diff_cell(d: dict | None) -> str:
    """``mean [lo, hi]`` (the t interval) or ``mean`` alone below two seeds; ``–`` for no comparison."""
    if not d or d.get("mean") is None:
        return "–"
    if not d.get("ci"):
        return f"{d['mean']:+.4f}"
    return f"{d['mean']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]"


def markdown_table(results: dict) -> str:
    rows = results["rows"]
    ns = sorted({d["n"] for r in rows.values() for k, d in r.items() if k.startswith("diff_vs_") and d.get("df")})
    level = next((d["ci_level"] for r in rows.values() for k, d in r.items() if k.startswith("diff_vs_")), 0.95)
    lines = [
        f"Table 2 reproduction: size={results['size']}, steps={results['steps'] or 'config default'}, "
        f"seeds={results['seeds']}. Loss: {results['loss']}; mean ± std over seeds. Differences are "
        f"paired by seed: mean and {100 * level:.0f}% interval from the t distribution with n - 1 degrees of "
        f"freedom (n = {', '.join(map(str, ns)) or '-'} common seeds); negative = better than the reference. "
        "No correction for the number of comparisons. Overheads from msar_jax.accounting at this config "
        "(ΔP: residual parameters, % of Vanilla's activated parameters; ΔF: training FLOPs, % of Vanilla "
        "incl. / excl. the LM head). Paper: 10B MoE, Pile loss.",
        "",
        "| Row | m | S | seeds | val loss | Δ vs Vanilla | Δ vs AttnRes | Δ vs MSAR | ΔP | ΔP % "
        "| ΔF % (incl./excl. head) | tokens/s | paper loss | paper Δ vs Vanilla |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        acc = r.get("accounting") or {}
        m = {"vanilla": "–", "attnres": "1"}.get(name, acc.get("streams", "-"))
        s = "–" if name in ("vanilla", "mhc") else acc.get("block_size", "-")
        cells = [
            f"{r['label']} (`{name}`)", str(m), str(s), str(r["n_seeds"]), _pm(r["mean"], r["std"]),
            *(_diff_cell(r.get(f"diff_vs_{ref}")) for ref in REFERENCES),
            f"{acc['residual_params']:,}" if acc else "-", _f(acc.get("residual_params_pct"), ".3f"),
            f"{_f(acc.get('flops_overhead_pct_incl_lm_head'), '.2f')} / {_f(acc.get('flops_overhead_pct_excl_lm_head'), '.2f')}",
            _f(r.get("tokens_per_s"), ",.0f"), f"{r['paper_loss']:.3f}", f"{r['paper_diff_vs_vanilla']:+.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(workdir, results: dict, *, figure5: bool = True, fig5_steps: int = 0, log=print) -> dict:
    """``results.json``, ``table.md`` and the PNGs in ``workdir``; returns the paths written."""
    from msar_jax.experiments import plots

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"results": workdir / "results.json", "table": workdir / "table.md"}
    paths["results"].write_text(json.dumps(results, indent=2), encoding="utf-8")
    paths["table"].write_text(markdown_table(results), encoding="utf-8")
    try:
        curves = plots.plot_training_curves(workdir, list(results["rows"]), results["seeds"], workdir / "curves.png",
                                            labels={k: v["label"] for k, v in results["rows"].items()})
        if curves:
            paths["curves"] = Path(curves)
        for name in results["rows"]:
            png = plots.plot_run_depth_weights(workdir / name, results["seeds"], workdir / f"depth_weights_{name}.png")
            if png:
                paths[f"depth_weights_{name}"] = Path(png)
        if figure5:
            paths["figure5"] = Path(plots.plot_mixing_matrices(workdir / "mixing_matrices.png", train_steps=fig5_steps))
    except Exception as e:  # plots never cost the table
        log(f"warning: plotting failed: {e!r}")
    return paths


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parse_list(text: str | None, allowed) -> list[str]:
    if not text or text == "all":
        return list(allowed)
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"unknown rows {bad}; known: {list(allowed)}")
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msar_jax.experiments.ablation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--size", default="small", help="config size (configs/common.py SIZES): tiny, small, base, ...")
    ap.add_argument("--seeds", type=positive_int, default=3, help="seeds 0..N-1")
    ap.add_argument("--rows", default="all", help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--steps", type=positive_int, default=None, help="override train.steps (warmup clipped to it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. --set train.batch_size=8 (repeatable; JSON values)")
    ap.add_argument("--shard", type=shard, default=(0, 1), help="i/n: run only the i-th of every n (row, seed) pairs")
    ap.add_argument("--report_only", action="store_true", help="train nothing; aggregate finished runs")
    ap.add_argument("--dry_run", action="store_true",
                    help="print the planned runs (config, tokens, accounting, finished or not) and exit")
    ap.add_argument("--no_figure5", action="store_true", help="skip the Figure 5 mixing-matrix plot")
    ap.add_argument("--fig5_steps", type=non_negative_int, default=0,
                    help="Figure 5: train the L=4 models this many CPU steps first (0 = perturbed init)")
    args = ap.parse_args(argv)

    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    rows = _parse_list(args.rows, ROWS)
    seeds = list(range(args.seeds))
    overrides = parse_overrides(args.set)
    shard_i, shard_n = args.shard
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    statuses = []
    if args.dry_run:
        for row in rows:
            spec = f"{ROWS[row][0]}:size={args.size}"
            cfg = build_config(spec, 0, args.steps, overrides)
            acc = accounting_summary(cfg)
            t = cfg.train
            done = [s for s in seeds if is_finished(workdir / row / f"seed{s}", t.steps)]
            print(f"{row:12s} {spec:45s} steps={t.steps} tokens={t.steps * t.batch_size * cfg.seq_len / 1e6:.1f}M "
                  f"params={acc['params_total'] / 1e6:.2f}M dP={acc['residual_params']:,} "
                  f"dF={acc['flops_overhead_pct_incl_lm_head']:.2f}% finished seeds={done}")
        return 0
    if not args.report_only:
        # Row-major: the seeds of a row run back to back, so they share one compiled train / eval
        # step (msar_jax.train.step caches the last one). Run --seeds=1 first for a quick full
        # table; a later --seeds=3 skips the finished seed-0 runs.
        pairs = [(row, seed) for row in rows for seed in seeds]
        for k, (row, seed) in enumerate(pairs):
            if k % shard_n != shard_i:
                continue
            spec = f"{ROWS[row][0]}:size={args.size}"
            config = build_config(spec, seed, args.steps, overrides)
            res = run_one(config, workdir / row / f"seed{seed}", label=f"{row} seed {seed} [{spec}]")
            statuses.append((row, seed, res["status"]))
            if res["status"] == "stopped":  # SIGTERM / SIGINT: saved; stop here, rerun to resume
                break
    results = aggregate(workdir, rows, seeds, args.size, args.steps, overrides)
    results["last_invocation"] = {"trained": sum(s == "trained" for *_, s in statuses),
                                  "skipped": sum(s == "skipped" for *_, s in statuses),
                                  "failed": [f"{r}/seed{s}" for r, s, st in statuses if st == "failed"],
                                  "stopped": [f"{r}/seed{s}" for r, s, st in statuses if st == "stopped"]}
    paths = write_outputs(workdir, results, figure5=not args.no_figure5, fig5_steps=args.fig5_steps)
    print(markdown_table(results))
    print(json.dumps(results["last_invocation"]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if results["last_invocation"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))  # a config error (--size, --set): one line, exit status 1

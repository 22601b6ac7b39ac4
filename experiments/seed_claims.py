"""
What each mechanism learns, over seeds (issue 55): the measures declared in
experiments/configs/seed_claims_mechanism.py, from each run's final checkpoint (tools.diagnose), their tests
(Holm within M1-M5) and two figures.

    python -m experiments.seed_claims experiments/configs/seed_claims_mechanism.py               # diagnose, then report
    python -m experiments.seed_claims experiments/configs/seed_claims_mechanism.py --table_only  # from stored diagnostics
    python -m experiments.seed_claims experiments/configs/seed_claims_mechanism.py --root /path/to/frozen/clone

Each run's diagnostics.json is written into its run directory once (computed again only if it was computed
on other tokens); the report (mechanism.md, mechanism.json, cka.png, rescue.png) goes to --out.
"""

import argparse
import json
import runpy
import statistics
import sys
from pathlib import Path

from common import ROOT, UserError, cli, write_atomic
from experiments.report import save_outputs, strict_json
from experiments.stats import holm, paired_t
from tools import pyplot, write_figure

CLAIMS = {  # test: (what it compares, the sign the papers predict)
    "M1": ("js(rd_attnres) - 0", "+"),
    "M2": ("js(rd_attnres) - paper_js", "two-sided"),
    "M3": ("imbalance(dar_self_kv) - imbalance(dar)", "+"),
    "M4": ("cka_off(dar_self_kv) - cka_off(dar)", "+"),
    "M5": ("cka_off(mhc2) - cka_off(dar)", "+"),
}


def figures(diag):
    """The per-run figures of one diagnostics.json: js, imbalance, cka_off, cka_diag (those it has)."""
    out = {}
    if "js_per_site" in diag:  # RD-AttnRes' two routes meet at the attention sites: one per layer
        out["js"] = statistics.fmean(diag["js_per_site"]["QK||V"].values())
    if "rescue_gain_per_layer" in diag:
        out["imbalance"] = statistics.fmean(abs(g["stream0"] - g["stream1"]) for g in diag["rescue_gain_per_layer"])
    if "cka_matrix" in diag:
        m = diag["cka_matrix"]
        out["cka_diag"] = statistics.fmean(m[i][i] for i in range(len(m)))
        out["cka_off"] = statistics.fmean(m[i][j] for i in range(len(m)) for j in range(len(m)) if i != j)
    return out


def read_diagnostics(design, name, seed, compute, root=ROOT):
    """A run's diagnostics on the declared tokens, computed (compute=True) where missing; None if absent."""
    out_dir, variant = design["runs"][name]
    d = Path(root) / out_dir / variant / f"seed{seed}"
    path = d / "diagnostics.json"
    if path.is_file():
        diag = json.loads(path.read_text())
        if diag.get("tokens") == design["tokens"]:
            return diag
    if not compute or not (d / "ckpt.pt").is_file():
        return None
    from tools.diagnose import diagnose
    return diagnose(str(d), tokens=design["tokens"])


def tests(design, per_run):
    """The declared tests M1-M5 (paired t over the seeds both runs have), Holm-adjusted within the family."""
    def values(name, key):
        return {s: f[key] for s, f in per_run[name].items() if key in f}

    js = values("rd_attnres", "js")
    imb = {n: values(n, "imbalance") for n in ("dar", "dar_self_kv")}
    cka = {n: values(n, "cka_off") for n in ("dar", "dar_self_kv", "mhc2")}

    def diff(a, b):
        return [a[s] - b[s] for s in sorted(a) if s in b]

    rows = {"M1": paired_t(list(js.values())), "M2": paired_t([x - design["paper_js"] for x in js.values()]),
            "M3": paired_t(diff(imb["dar_self_kv"], imb["dar"])), "M4": paired_t(diff(cka["dar_self_kv"], cka["dar"])),
            "M5": paired_t(diff(cka["mhc2"], cka["dar"]))}
    for key, p in zip(rows, holm([rows[k]["p"] for k in rows])):
        rows[key].update(test=CLAIMS[key][0], predicted=CLAIMS[key][1], p_holm=p,
                         reject=p < design["alpha"], agrees=p < design["alpha"] and (
                             CLAIMS[key][1] == "two-sided" or (rows[key]["mean"] > 0) == (CLAIMS[key][1] == "+")))
    return rows


def per_layer(per_run_diag, key):
    """{name: mean over seeds of a per-layer list or matrix} (the figures' data)."""
    out = {}
    for name, runs in per_run_diag.items():
        got = [d[key] for d in runs.values() if key in d]
        if got:
            out[name] = [[statistics.fmean(x) for x in zip(*rows)] for rows in zip(*got)] if isinstance(got[0][0], list) \
                else [statistics.fmean(x) for x in zip(*got)]
    return out


def table(rows, means, n_runs):
    lines = ["| test | what | predicted | mean [95% CI] | n | p | p (Holm) | verdict |", "|" + " --- |" * 8]
    for key, r in rows.items():
        verdict = ("agrees with the paper" if r["agrees"] else "rejects, against the paper") if r["reject"] else "not shown"
        lines.append(f"| {key} | {r['test']} | {r['predicted']} | {r['mean']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] | {r['n']} "
                     f"| {r['p']:.3g} | {r['p_holm']:.3g} | {verdict} |")
    keys = sorted({k for m in means.values() for k in m})
    lines += ["", "| run | " + " | ".join(keys) + " |"]
    lines.append("| --- |" + " --- |" * len(keys))
    for name, m in means.items():
        lines.append(f"| {name} ({n_runs[name]} seeds) | " + " | ".join(f"{m[k]:.4f}" if k in m else "" for k in keys) + " |")
    return "\n".join(lines)


def plot_cka(matrices, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(matrices), figsize=(4 * len(matrices), 3.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], matrices.items()):
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", origin="lower")
        ax.set_title(f"{name}: CKA(stream 0 @ i, stream 1 @ j)", fontsize=8)
        ax.set_xlabel("layer j (stream 1)")
        ax.set_ylabel("layer i (stream 0)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    write_figure(path, fig)
    return path


def plot_rescue(gains, path):
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, layers in gains.items():
        for m, style in ((0, "-"), (1, "--")):
            ax.plot(range(len(layers)), [g[m] for g in layers], style, marker="o", label=f"{name}, keep stream {m}")
    ax.set_xlabel("layer")
    ax.set_ylabel("rescue gain (mean over seeds)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(path, fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("design", help="experiments/configs/seed_claims_mechanism.py")
    p.add_argument("--table_only", action="store_true", help="use the stored diagnostics only; compute nothing")
    p.add_argument("--out", default=str(ROOT / "runs/seed_claims_mechanism"), help="where the report goes")
    p.add_argument("--root", default=str(ROOT), help="where the runs' out_dirs are (default: this checkout; a frozen "
                                                     "clone's for a study run from one)")
    args = p.parse_args(argv)
    if not Path(args.design).is_file():
        raise UserError(f"no design file {args.design}: pass experiments/configs/seed_claims_mechanism.py")
    design = runpy.run_path(args.design)
    diags = {name: {} for name in design["runs"]}
    for seed in design["seeds"]:
        for name in design["runs"]:
            if (d := read_diagnostics(design, name, seed, not args.table_only, args.root)) is not None:
                diags[name][seed] = d
    missing = [f"{n} seed {s}" for n in design["runs"] for s in design["seeds"] if s not in diags[n]]
    per_run = {n: {s: figures(d) for s, d in runs.items()} for n, runs in diags.items()}
    rows = tests(design, per_run)
    means = {n: {k: statistics.fmean(f[k] for f in runs.values() if k in f)
                 for k in sorted({k for f in runs.values() for k in f})}  # sorted: the same bytes on every rebuild
             for n, runs in per_run.items() if runs}
    text = table(rows, means, {n: len(r) for n, r in per_run.items()})
    if missing:
        text += f"\n\n{len(missing)} runs without diagnostics (not finished, or no checkpoint): " + ", ".join(missing[:8])
    print(text)
    gains = {n: [[statistics.fmean(x) for x in zip(*layer)] for layer in
                 zip(*([(g["stream0"], g["stream1"]) for g in d["rescue_gain_per_layer"]] for d in diags[n].values()))]
             for n in ("dar", "dar_self_kv") if diags[n]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(tests=rows, means=means, per_run=per_run, missing=missing, tokens=design["tokens"])
    save_outputs(out, {"mechanism.md": lambda q: write_atomic(q, (text + "\n").encode()),
                       "mechanism.json": lambda q: write_atomic(q, (json.dumps(strict_json(result), indent=1) + "\n").encode()),
                       "cka.png": lambda q: plot_cka(per_layer({n: diags[n] for n in ("dar", "dar_self_kv", "mhc2")},
                                                               "cka_matrix"), q),
                       "rescue.png": lambda q: plot_rescue(gains, q)}, "the tables above are complete")
    return 0


if __name__ == "__main__":
    sys.exit(cli(main))

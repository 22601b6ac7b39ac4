"""What did a model's depth routing learn? Diagnostics from a checkpoint, on held-out tokens (docs/experiments.md).

    python -m tools.diagnose --ckpt runs/rd                    # routing maps, and per variant:
        rd_attnres: JS between its routes; dar, hc, mhc: CKA between streams (dar: rescue gains; hc, mhc: mixing
        matrices); full/block/delta_attnres: the peak routing weight; denseformer: DWA weights; muddformer: per way
    python -m tools.diagnose --curves runs/sweep/*/seed*/      # validation-loss curves across runs

Writes diagnostics.json and PNGs (with matplotlib) into --out, from the validation split of --data_dir (defaults: the
run's). Exit status: 0 done; 2 one `error:` line, before any compute.
"""

import argparse
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python tools/diagnose.py` as `python -m tools.diagnose`
import torch

import tools as files
from common import ROOT, UserError, cli, log_records, need, os_error_message, perplexity, read_json, write_atomic
from data import eval_batches, load_meta
from model import AttnRes, DARStream
from model_fast import load_model
from tools import pyplot, write_figure

# --- the measures ---------------------------------------------------------------------------------

def js_divergence(p, q, dim=0):
    """Jensen-Shannon divergence along `dim`, natural log (at most ln 2)."""
    m = 0.5 * (p + q)

    def kl(a, b):
        return torch.where(a > 0, a * (a.clamp_min(1e-30).log() - b.clamp_min(1e-30).log()), 0.0).sum(dim)

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def linear_cka(X, Y):
    """Linear CKA of [N, d] features: ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F), centred."""
    X, Y = X.double() - X.double().mean(0), Y.double() - Y.double().mean(0)
    return ((Y.T @ X).square().sum() / (torch.linalg.matrix_norm(X.T @ X) * torch.linalg.matrix_norm(Y.T @ Y))).item()


def rescue_gain(d_none, d_kept):
    """1 - D_m / D_none: the share of the loss increase that keeping stream m intact avoids."""
    return 1.0 - d_kept / d_none


# --- running a model over held-out batches ---------------------------------------------------------

@torch.no_grad()
def collect(model, batches):
    losses, records = [], []
    for x, y in batches:
        rec = {}
        losses.append(model(x, y, record=rec)[1].item())
        records.append({k: v.cpu() for k, v in rec.items()})
    return sum(losses) / len(losses), records


def routing_maps(records):
    """{site: mean routing weights over held-out tokens}."""
    return {site: torch.cat([r[site].flatten(start_dim=r[site].dim() - 2) for r in records], -1).mean(-1)  # tokens last
            for site in site_keys(records[0])}


def route_js(records, names):
    """{"A||B": {site: JS}} for every pair of a site's named routes, averaged over tokens."""
    out, names = {}, [name.removesuffix(" route") for name in names]
    for site in site_keys(records[0]):
        if records[0][site].dim() == 4 and records[0][site].size(1) == len(names):
            a = torch.cat([r[site].flatten(start_dim=2) for r in records], -1)  # [n, routes, tokens]
            for x, y in itertools.combinations(range(len(names)), 2):
                out.setdefault(f"{names[x]}||{names[y]}", {})[site] = js_divergence(a[:, x], a[:, y]).mean().item()
    return out


def stream_cka(records, n_layer):
    """Linear CKA between stream 0 after layer i and stream 1 after layer j, [n_layer][n_layer]."""
    dar = recorded_kind(records) == "two_targets"  # states: DAR's [2, B, T, d]; HC's, mHC's [B, T, n, d]
    states = [[r[f"state.{2 * i + 1}"] for r in records] for i in range(n_layer)]
    s = [torch.cat([(x if dar else x.movedim(-2, 0))[:2].flatten(1, 2) for x in xs], 1) for xs in states]  # [2, tokens, d]
    return [[linear_cka(s[i][0], s[j][1]) for j in range(n_layer)] for i in range(n_layer)]


class AblatedDARStream(DARStream):
    """DARStream with target t's retrieval at site j (t in ablate[j]) replaced by its token mean."""

    def __init__(self, mod, x0, record, ablate):
        super().__init__(mod, x0, record)
        self.ablate = ablate

    def retrieve(self, j):
        r = list(super().retrieve(j))
        for t in self.ablate.get(j, ()):
            r[t] = r[t].mean(dim=(0, 1), keepdim=True).expand_as(r[t])
        return r


@torch.no_grad()
def dar_rescue_gains(model, batches, base_loss):
    """Per layer: [gain_0, gain_1, D_none]."""
    module, gains = model.residual, []
    for i in range(model.cfg.n_layer):
        d = {}
        for kept, ablate in (("none", (0, 1)), (0, (1,)), (1, (0,))):
            targets = {2 * i: ablate, 2 * i + 1: ablate}
            module.start = lambda x0, record=None: AblatedDARStream(module, x0, record, targets)  # not DARStream
            try:
                d[kept] = collect(model, batches)[0] - base_loss
            finally:
                del module.start
        gains.append([rescue_gain(d["none"], d[0]), rescue_gain(d["none"], d[1]), d["none"]])
    return gains


def max_weight_per_site(records):
    """{site: a token's largest routing weight, averaged}, for one-route sites."""
    return {site: torch.cat([r[site].amax(0).flatten() for r in records]).mean().item()
            for site in site_keys(records[0]) if records[0][site].dim() == 3 and records[0][site].size(0) > 1}


def dwa_weights(records, n_layer, k):
    """DenseFormer: {"dwa.i": alpha_{i,j} over j = 0..n_layer, NaN where j is not in S(i)}."""
    out = {}
    for i in range(1, n_layer + 1):
        if f"dwa.{i}" in records[0]:
            row = torch.full((n_layer + 1,), float("nan"))
            row[i % k:i + 1:k] = records[0][f"dwa.{i}"].float()  # static weights: one batch tells
            out[f"dwa.{i}"] = row
    return out


def mudd_way_summary(maps):
    """MUDDFormer: per way, the mean weight on the newest output and on x0."""
    ways = [m for site, m in maps.items() if m.dim() == 2]  # [4 ways, n sources]
    return {way: dict(newest=statistics.fmean(m[c, -1].item() for m in ways),
                      embedding=statistics.fmean(m[c, 0].item() for m in ways))
            for c, way in enumerate("QKVR")}


def mixing_matrices(records):
    """{site: mean H_res (mhc) / Ar (hc) over tokens, [n, n]}."""
    return {key.removesuffix("/res"): torch.cat([r[key].flatten(0, 1) for r in records]).mean(0)
            for key in records[0] if key.endswith("/res")}


def recorded_kind(records):
    """What a record holds, from its layout (docs/model.md)."""
    keys = set(records[0])
    if any(k.endswith("/alpha") for k in keys):
        return "two_targets"
    if any(k.endswith("/res") for k in keys):
        return "mixing"
    if any(k.startswith("dwa.") for k in keys):
        return "dwa"
    sites = site_keys(records[0])
    if not sites:
        return None
    return "routes" if "mlp.0" in keys or all(records[0][k].dim() == 3 for k in sites) else "ways"


def site_keys(record):
    """A record's keys of sites' routing weights, in depth order."""
    return [k for k in record if "/" not in k and not k.startswith("state.")]


def route_names(records, declared=None):
    """The routes' names: the variant's own where they fit, else by the layout."""
    kind = recorded_kind(records)
    if kind == "routes":
        R = max((records[0][k].size(1) for k in site_keys(records[0]) if records[0][k].dim() == 4), default=1)
        names = ("routing weights",) if R == 1 else tuple(f"route {r}" for r in range(R))
    else:
        names = {"two_targets": ("stream 0", "stream 1"), "ways": ("Q way", "K way", "V way", "R way"),
                 "dwa": ("DWA weights",)}.get(kind, ("routing weights",))
    return tuple(declared) if declared is not None and len(declared) == len(names) else names


# --- plots (optional matplotlib) ----------------------------------------------------------------------

def plot_routing_maps(maps, path, title, kind, names, partial=False):
    """One heatmap per route, a row per site, a column per source (0 = embedding)."""
    plt = pyplot()
    if plt is None:
        return None
    # a site's routes [n, R]; DAR sites [2 targets, n]; MUDD sites [4 ways, n]; one-route sites [n]
    routes = {name: {site: m if m.dim() == 1 else m[:, r] if kind == "routes" else m[r] for site, m in maps.items()}
              for r, name in enumerate(names)}
    signed = kind in ("dwa", "ways")
    top = max(v.nan_to_num().abs().max().item() for v in maps.values()) if signed else 1.0
    scale = dict(cmap="RdBu_r", vmin=-top, vmax=top) if signed else dict(cmap="viridis", vmin=0, vmax=1)
    fig, axes = plt.subplots(1, len(routes), figsize=(4.5 * len(routes), 6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], routes.items()):
        grid = torch.nn.utils.rnn.pad_sequence(list(rows.values()), batch_first=True, padding_value=float("nan"))
        im = ax.imshow(grid.numpy(), aspect="auto", **scale)
        ax.set_yticks(range(len(rows)), list(rows), fontsize=6)
        ax.set_xlabel("source (0 = embedding)" + ("; a site's last, within a block: its partial sum" if partial else ""))
        ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.6)
    fig.suptitle(title, fontsize=10)
    return write_figure(path, fig)


def plot_curves(groups, path):
    """Validation loss against step, the mean of each group of runs."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, runs) in enumerate(groups.items()):
        curves = [dict(val_curve(run)) for run in runs]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        style = ("-", "--", ":")[i // 10 % 3]  # the colour cycle repeats after 10 lines; the style does not
        ax.plot(steps, [statistics.fmean(c[s] for c in curves) for s in steps], style, label=f"{label} ({len(runs)})",
                marker="o" if len(steps) == 1 else None)  # one evaluation: a point, not an invisible line
    ax.set_xlabel("step")
    units = {(read_json(Path(run) / "config.json") or {}).get("tokenizer") == "byte" for runs in groups.values()
             for run in runs}
    ax.set_ylabel(f"validation loss (nats/{'byte' if units == {True} else 'token'})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return write_figure(path, fig)


def plot_scalars(scalars, path, title):
    """A variant's own `scalars()`, one line per name over the sites."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, values in scalars.items():
        ax.plot(range(len(values)), values, marker="o", label=name)
    ax.set_xlabel("site j (sublayer; the last: the readout)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return write_figure(path, fig)


# --- the command -----------------------------------------------------------------------------------

def default_out(ckpt_path):
    return ckpt_path if os.path.isdir(ckpt_path) else os.path.dirname(ckpt_path) or "."


def check_writable(directory, what):
    """Create `directory` and write a probe into it; UserError if not."""
    try:
        os.makedirs(directory, exist_ok=True)
        files.check_writable(directory)
    except OSError as e:
        reason = os_error_message(e, directory).removeprefix(f"cannot write {directory}: ")
        raise UserError(f"cannot write {what} into {directory}: {reason}: pass --out with a writable "
                        f"{'directory' if what == 'the diagnostics' else 'path'}") from None


def find_data_dir(recorded, given=None):
    """(the data directory, a note of where it was found): --data_dir, else the checkpoint's."""
    if given is not None:
        if not (Path(given) / "meta.json").is_file():
            raise UserError(f"--data_dir {given} holds no meta.json: pass the directory prepare_data.py wrote")
        return str(given), None
    path = Path(recorded)
    places = [path] if path.is_absolute() else list(dict.fromkeys([Path.cwd() / path, ROOT / path]))
    for place in places:
        if (place / "meta.json").is_file():
            return str(place), None if place == path else f"data_dir {recorded} (from the checkpoint) is {place}"
    raise UserError(f"the checkpoint's data_dir {recorded} holds no prepared data: looked in "
                    f"{' and '.join(map(str, places))}; pass --data_dir with the directory prepare_data.py wrote "
                    "for this run")


@torch.no_grad()
def diagnose(ckpt_path, out_dir=None, tokens=16384, batch_size=8, device="cpu", data_dir=None):
    """A checkpoint's diagnostics, written into out_dir; every check first."""
    model, ckpt = load_model(ckpt_path, device)
    cfg = model.cfg
    data_dir, note = find_data_dir(ckpt.get("train_config", {}).get("data_dir", "data/shakespeare"), data_dir)
    meta = load_meta(data_dir)
    if meta["tokenizer"] != ckpt["tokenizer"] or meta["vocab_size"] > cfg.vocab_size:
        raise UserError(f"{data_dir} holds {meta['tokenizer']} tokens ({meta['vocab_size']} ids), but the checkpoint's "
                        f"model reads {ckpt['tokenizer']} tokens ({cfg.vocab_size} ids): pass --data_dir with the "
                        "data of this run")
    if note:
        print(note)
    batches = [(x.to(device), y.to(device)) for x, y in
               eval_batches(data_dir, "val", batch_size, cfg.block_size, tokens)]
    loss, records = collect(model, batches)
    out = dict(checkpoint=str(ckpt_path), data_dir=data_dir, residual=cfg.residual, step=ckpt["step"], tokens=tokens,
               val_loss=loss)
    n, kind, maps = cfg.n_layer, recorded_kind(records), None
    names = route_names(records, getattr(model.residual, "route_names", None))
    if kind in ("routes", "two_targets", "ways"):
        maps = routing_maps(records)
        out["routing_maps"] = {k: v.tolist() for k, v in maps.items()}
    if kind == "routes" and len(names) == 1:
        peak = max_weight_per_site(records)
        out["max_weight_per_site"], out["max_weight_mean"] = peak, statistics.fmean(peak.values()) if peak else None
    elif kind == "routes":
        out["js_per_site"] = route_js(records, names)
        out["js_mean"] = {pair: statistics.fmean(js.values()) for pair, js in out["js_per_site"].items()}
    elif kind == "dwa":  # NaN (j not in S(i)) as null in the JSON
        maps = dwa_weights(records, n, cfg.denseformer_dilation or 1)
        out["dwa_weights"] = {k: [None if math.isnan(x) else x for x in v.tolist()] for k, v in maps.items()}
    elif kind == "ways":
        out["mudd_ways"] = mudd_way_summary(maps)
    if kind in ("two_targets", "mixing"):  # two streams or more: their similarity across depths
        out["cka_matrix"] = stream_cka(records, n)
        out["cka_per_layer"] = [out["cka_matrix"][i][i] for i in range(n)]
    if kind == "two_targets":
        out["rescue_gain_per_layer"] = [dict(stream0=g0, stream1=g1, d_none=dn)
                                        for g0, g1, dn in dar_rescue_gains(model, batches, loss)]
    if kind == "mixing":
        out["mixing_matrices"] = {k: v.tolist() for k, v in mixing_matrices(records).items()}
    if hasattr(model.residual, "scalars"):  # a variant's own values (docs/adding_a_variant.md)
        out["scalars"] = {k: torch.as_tensor(v).flatten().tolist() for k, v in model.residual.scalars().items()}

    out_dir = out_dir or default_out(ckpt_path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        if maps:
            partial = getattr(model.residual, "include_partial", isinstance(model.residual, AttnRes)) and \
                getattr(model.residual, "S", 1) > 1  # (Block AttnRes, RD-AttnRes, DAR)
            out["routing_plot"] = plot_routing_maps(maps, os.path.join(out_dir, "routing.png"),
                                                    f"{cfg.residual}, step {ckpt['step']}", kind, names, partial)
        if out.get("scalars"):
            out["scalars_plot"] = plot_scalars(out["scalars"], os.path.join(out_dir, "scalars.png"),
                                               f"{cfg.residual}, step {ckpt['step']}")
        path = os.path.join(out_dir, "diagnostics.json")
        write_atomic(path, json.dumps(out, indent=1) + "\n")
    except OSError as e:  # computed, then the disk failed: the numbers are printed, not lost
        print(summary(out))
        raise UserError(f"{os_error_message(e, out_dir)}; the summary above is all that was kept") from None
    return out


def summary(d):
    lines = [f"{d['residual']} at step {d['step']}: val loss {d['val_loss']:.4f} on the first {d['tokens']:,} val tokens "
             f"(ppl {perplexity(d['val_loss']):.2f}; summary.json's val loss may read other tokens)"]
    for pair, js in d.get("js_per_site", {}).items():
        lines.append(f"JS({pair.replace('||', ' || ')}) per site: " + " ".join(f"{k} {x:.3f}" for k, x in js.items())
                     + f"  mean {d['js_mean'][pair]:.3f} (max ln 2 = 0.693)")
    if "cka_per_layer" in d:
        lines.append("stream CKA per layer: " + " ".join(f"{x:.3f}" for x in d["cka_per_layer"]))
    if "rescue_gain_per_layer" in d:  # DAR only: HC/mHC's streams have CKA, no rescue
        lines.append("rescue gain per layer (stream 0 / stream 1): " +
                     " ".join(f"{g['stream0']:.2f}/{g['stream1']:.2f}" for g in d["rescue_gain_per_layer"]))
    if d.get("max_weight_mean") is not None:
        lines.append("largest routing weight per token, mean per site: " +
                     " ".join(f"{x:.2f}" for x in d["max_weight_per_site"].values()) + f"  mean {d['max_weight_mean']:.3f}")
    if "dwa_weights" in d:
        lines.append("DWA weight on the current output (init 1): " +
                     " ".join(f"{k}={[x for x in v if x is not None][-1]:.2f}" for k, v in d["dwa_weights"].items()))
        last = list(d["dwa_weights"])[-1]
        lines.append(f"{last} over x0, X_1, ..: " + " ".join("-" if x is None else f"{x:.2f}" for x in d["dwa_weights"][last]))
    if "mudd_ways" in d:
        lines.append("MUDD mean weight per way, on the newest output (init 1) / on x0 (init 0): " +
                     " ".join(f"{w} {v['newest']:.2f}/{v['embedding']:.2f}" for w, v in d["mudd_ways"].items()))
    if "mixing_matrices" in d:
        last = list(d["mixing_matrices"])[-1]
        lines.append(f"mean mixing matrix at {last}: " + str([[round(x, 3) for x in row] for row in d["mixing_matrices"][last]]))
    for name, values in d.get("scalars", {}).items():
        lines.append(f"{name}: " + " ".join(f"{x:.3g}" for x in values))
    return "\n".join(lines)


def parse_device(name, choices="cpu, cuda or cuda:N"):
    """The torch.device --device names (cpu or an existing CUDA device), else UserError."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name} is not a device: use {choices}") from None
    need(device.type in ("cpu", "cuda"), f"--device {name}: use {choices}")
    if device.type == "cuda":
        need(torch.cuda.is_available(), f"--device {name}: no CUDA device is available")
        need(device.index is None or device.index < torch.cuda.device_count(),
             f"--device {name}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def check_args(args):
    """Every flag, and where the results go (--out's default too), before any compute."""
    need(args.tokens >= 1, f"--tokens must be at least 1, got {args.tokens}")
    need(args.batch_size >= 1, f"--batch_size must be at least 1, got {args.batch_size}")
    parse_device(args.device)
    for run in args.curves or []:
        need(os.path.isfile(os.path.join(run, "log.jsonl")),
             f"--curves {run}: no log.jsonl there (not a train.py run directory)")
    if args.ckpt:
        need(args.out is None or not os.path.exists(args.out) or os.path.isdir(args.out),
             f"--out {args.out} is a file: diagnose writes diagnostics.json and routing.png into a directory")
        args.out = args.out or default_out(args.ckpt)
    elif args.out:
        need(not os.path.isdir(args.out),
             f"--out {args.out} is a directory: with --curves alone, --out is the PNG file to write")
    mine = [curves_path(args)] if args.curves else []
    mine += [os.path.join(args.out, f) for f in ("diagnostics.json", "routing.png", "scalars.png")] if args.ckpt else []
    for path in mine:  # a file there that a tool did not write is someone's (a checkpoint, a log, a figure)
        need(files.ours(path), f"{path} exists and is not one diagnose wrote: it writes over no file it did not make; "
             "pass --out with a new path")
    if args.curves:
        check_writable(os.path.dirname(curves_path(args)) or ".", "the curves")
    if args.ckpt:
        check_writable(args.out, "the diagnostics")


def val_curve(d):
    """(step, val loss) of every evaluation on the run's eval_tokens (not a final score on other tokens)."""
    return [(r["step"], r["loss"]) for r in log_records(d) if r.get("kind") == "eval" and r.get("split") == "val"
            and not r.get("final") and isinstance(r.get("step"), int) and isinstance(r.get("loss"), (int, float))]


def curve_labels(runs):
    """{label: [run]}: each run by its path from the runs' common parent."""
    paths = [os.path.abspath(r) for r in runs]
    parent = os.path.commonpath(paths)
    parent = os.path.dirname(parent) if parent in paths else parent
    return {os.path.relpath(p, parent): [r] for p, r in zip(paths, runs, strict=True)}


def curves_path(args):
    if args.ckpt:
        return os.path.join(args.out, "curves.png")
    return args.out or os.path.join(os.path.commonpath([os.path.abspath(run) for run in args.curves]), "curves.png")


def main(argv=None):
    return cli(run, argv)


def run(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", help="run directory or checkpoint file")
    p.add_argument("--curves", nargs="+", metavar="RUN_DIR", help="plot validation curves of these runs")
    p.add_argument("--out", help="output directory (default: the run directory) or, with --curves alone, the PNG "
                   "path (default curves.png; with --ckpt too, curves.png in --out)")
    p.add_argument("--data_dir", help="the prepared data to read (default: the checkpoint's data_dir)")
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens to average over")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    args = p.parse_args(argv)
    if not args.ckpt and not args.curves:
        p.error("give --ckpt or --curves")
    check_args(args)
    wrote = []
    if args.curves:
        path = curves_path(args)
        try:
            wrote.append(plot_curves(curve_labels(args.curves), path))
        except OSError as e:
            raise UserError(os_error_message(e, path)) from None
    if args.ckpt:
        out = diagnose(args.ckpt, args.out, args.tokens, args.batch_size, args.device, args.data_dir)
        print(summary(out))
        wrote += [out.get("routing_plot"), os.path.join(args.out, "diagnostics.json")]
    if any(wrote):  # a plot without matplotlib: None
        print("wrote " + ", ".join(path for path in wrote if path))
    return 0


if __name__ == "__main__":
    sys.exit(main())

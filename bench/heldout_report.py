#!/usr/bin/python3
"""The held-out compression table and plot from heldout_bench --csv files (one per model).

  /usr/bin/python3 bench/heldout_report.py --png bench/heldout.png A.csv [B.csv ...] > table.md

Prints one Markdown table with every model's row of each setting side by side (the first CSV's
setting order), then the headline per model: the largest ratio of each kvtrie family (and KVTC)
whose KL is at or below TurboQuant-4bit's, and the bits/component at TurboQuant-3bit's error (the
@tq3 rows). With --png, draws ratio vs fp16 against KL, one panel per model (needs matplotlib,
Debian python3-matplotlib). Lossless rows (KL 0) are not drawn (log axis).
"""

import argparse
import csv

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

STYLE = {
    "residual-fast": ("tab:blue", "o-"),
    "residual-compact": ("tab:green", "s-"),
    "learned-fast": ("tab:cyan", "*-"),
    "turboquant": ("tab:red", "^"),
    "kivi2": ("tab:purple", "D"),
    "int8": ("tab:gray", "v"),
    "kvtc": ("tab:orange", "P-"),
}


def family(setting):
    for k in STYLE:
        if setting.startswith(k):
            return k
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--png", default="")
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args()
    panels = []
    for path in args.csv:
        rows = list(csv.DictReader(open(path)))
        panels.append((rows[0]["model"], rows))
    table(panels)
    if args.png:
        plot(panels, args.png)


def f(r, k):
    return float(r[k])


def table(panels):
    print("| setting | model | bits/component | ratio vs fp16 | rel RMS K / V | worst plane | "
          "ΔNLL % ± s.e. | KL bits/token ± s.e. |")
    print("|---|---|---|---|---|---|---|---|")
    by = [{r["setting"]: r for r in rows} for _, rows in panels]
    for setting in [r["setting"] for r in panels[0][1]]:
        for (model, _), rows in zip(panels, by):
            r = rows.get(setting)
            if r is None:
                continue
            name = setting if "@tq" not in setting else f"{setting} ({f(r, 'target'):.3f})"
            print(f"| {name} | {model} | {f(r, 'bits_per_component'):.3f} | "
                  f"{f(r, 'ratio'):.2f}x | {f(r, 'rel_k'):.3f} / {f(r, 'rel_v'):.3f} | "
                  f"{f(r, 'worst_plane'):.3f} | {f(r, 'delta_nll_pct'):+.3f} ± "
                  f"{f(r, 'se_pct'):.3f} | {f(r, 'kl_bits'):.5f} ± {f(r, 'kl_se'):.5f} |")
    print()
    for model, rows in panels:
        rs = {r["setting"]: r for r in rows}
        tq4 = rs.get("turboquant/4")
        if tq4 is None:
            continue
        kl4 = f(tq4, "kl_bits")
        parts = []
        for fam in ("residual-fast", "residual-compact", "learned-fast", "kvtc"):
            ok = [r for r in rows if family(r["setting"]) == fam and f(r, "kl_bits") <= kl4]
            if ok:
                best = max(ok, key=lambda r: f(r, "ratio"))
                parts.append(f"{fam} {f(best, 'ratio'):.2f}x ({best['setting']}, KL "
                             f"{f(best, 'kl_bits'):.5f})")
            else:
                parts.append(f"{fam}: no setting")
        print(f"- {model}, at TurboQuant-4bit's KL ({kl4:.5f}; TurboQuant-4bit itself "
              f"{f(tq4, 'ratio'):.2f}x): " + "; ".join(parts) + ".")
        at3 = [r for r in rows if r["setting"].endswith("@tq3")]
        if at3 and "turboquant/3" in rs:
            print(f"- {model}, at TurboQuant-3bit's error (rel RMS "
                  f"{f(at3[0], 'target'):.3f}; TurboQuant-3bit itself "
                  f"{f(rs['turboquant/3'], 'bits_per_component'):.3f} bits/component, KL "
                  f"{f(rs['turboquant/3'], 'kl_bits'):.5f}): " + "; ".join(
                      f"{r['setting'][:-4]} {f(r, 'bits_per_component'):.3f} bits/component "
                      f"({f(r, 'ratio'):.2f}x, KL {f(r, 'kl_bits'):.5f})" for r in at3) + ".")


def plot(panels, out):
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], panels):
        series = {}
        for r in rows:
            fam = family(r["setting"])
            if fam is None or f(r, "kl_bits") <= 0:
                continue
            series.setdefault(fam, []).append(r)
        for fam, pts in series.items():
            color, marker = STYLE[fam]
            if marker.endswith("-"):  # a curve over its targets (the @tq rows drawn as points)
                line = sorted((r for r in pts if "@tq" not in r["setting"]),
                              key=lambda r: f(r, "target"))
                ax.plot([f(r, "kl_bits") for r in line], [f(r, "ratio") for r in line], marker,
                        color=color, label=fam)
                for r in pts:
                    if "@tq" in r["setting"]:
                        ax.plot([f(r, "kl_bits")], [f(r, "ratio")], marker[0], color=color,
                                mfc="none", ms=9)
                    ax.annotate(r["setting"].split("@")[-1], (f(r, "kl_bits"), f(r, "ratio")),
                                fontsize=7, textcoords="offset points", xytext=(4, 4),
                                color=color)
            else:
                for i, r in enumerate(pts):
                    kl, se = f(r, "kl_bits"), f(r, "kl_se")
                    ax.errorbar([kl], [f(r, "ratio")], xerr=[[min(se, kl * 0.999)], [se]],
                                fmt=marker, color=color, ms=8, label=None if i else fam)
                    ax.annotate(r["setting"], (kl, f(r, "ratio")), fontsize=8,
                                textcoords="offset points", xytext=(6, -10), color=color)
        tq4 = [r for r in rows if r["setting"] == "turboquant/4"]
        if tq4:
            ax.axvline(f(tq4[0], "kl_bits"), ls="--", color="tab:red", alpha=0.4)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
        ax.set_xlabel("KL vs the fp16 KV (bits/token, held-out documents, log)")
        ax.set_ylabel("ratio vs fp16 (log)")
        ax.set_title(f"{model}: up (smaller) and left (closer to fp16) is better\n"
                     "dashed: TurboQuant-4bit's KL; open marks: at TurboQuant-3bit's error",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()

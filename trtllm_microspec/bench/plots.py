"""The paper's figures from a bench result: Fig. 6 (speed and acceptance length against W_max) and Fig. 1b
(coverage against draft vocabulary size: static top-K curves vs the paper's window as points and the filled window
as a line over W_max); with --concurrency, throughput
against latency per method over the concurrency levels."""
from __future__ import annotations

from pathlib import Path


def plot_all(res: dict, out: Path) -> list[str]:
    """Writes the PNGs it can; returns notes on those it could not."""
    try:
        import matplotlib
    except ImportError:
        return ["no plots: matplotlib is not installed (pip install matplotlib)"]
    matplotlib.use("Agg")  # files only, no display
    notes = []
    from .specbench import WINDOWS

    micro = {m: sorted((r for r in res["runs"].values() if r["method"] == m and r.get("summary")),
                       key=lambda r: r["w_max"]) for m in WINDOWS}
    micro = {m: runs for m, runs in micro.items() if runs}  # window method -> its runs by W_max
    if micro:
        fig6(micro, out / "fig6_wmax.png")
    else:
        notes.append("no fig6_wmax.png: no microspec run")
    if res.get("static_coverage") or micro:
        fig1b(res, micro, out / "fig1b_coverage.png")
    else:
        notes.append("no fig1b_coverage.png: neither static coverage nor a microspec run")
    batched = {n: r["batched"] for n, r in res["runs"].items() if r.get("batched")}
    if batched:
        throughput_latency(batched, out / "throughput_latency.png")
    return notes


def throughput_latency(batched: dict[str, list[dict]], path: Path) -> None:
    """Output tokens/s against mean request latency (from submission), one line per method through its concurrency levels."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, levels in batched.items():
        levels = [b for b in levels if all(r["latency_s"] is not None for r in b["per_request"])]  # times known
        lat = [sum(r["latency_s"] for r in b["per_request"]) / b["requests"] for b in levels]
        ax.plot(lat, [b["output_tokens_per_s"] for b in levels], "o-", label=name)
        for x, b in zip(lat, levels):
            ax.annotate(str(b["concurrency"]), (x, b["output_tokens_per_s"]), fontsize=7)
    ax.set_xlabel("mean request latency (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs latency over concurrency (labels)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LOOK = {"microspec-paper": ("*", ":", "MicroSpec (paper)"), "microspec": ("D", "-", "MicroSpec filled")}


def fig6(micro: dict[str, list[dict]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax2 = ax.twinx()
    ticks = sorted({r["w_max"] for runs in micro.values() for r in runs})
    for method, runs in micro.items():
        marker, line, name = LOOK[method]
        w = [r["w_max"] for r in runs]
        ax.plot(w, [r["summary"]["overall"]["speed"] for r in runs], marker=marker, linestyle=line,
                color="tab:green", label=f"{name}: speed")
        ax2.plot(w, [r["summary"]["overall"]["acceptance_length"] or 0 for r in runs], marker=marker,
                 linestyle=line, color="tab:blue", label=f"{name}: acceptance length")
    ax.set_xscale("log", base=2)  # the paper's W_max points double
    ax.set_xticks(ticks, [str(x) for x in ticks])
    ax.set_xlabel("W_max")
    ax.set_ylabel("tokens/s", color="tab:green")
    ax2.set_ylabel("mean acceptance length", color="tab:blue")
    if len(micro) > 1:  # one legend for both axes' lines
        lines = ax.get_legend_handles_labels(), ax2.get_legend_handles_labels()
        ax2.legend(lines[0][0] + lines[1][0], lines[0][1] + lines[1][1], fontsize=6, loc="best")
    ax.set_title("MicroSpec: speed and acceptance length vs W_max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fig1b(res: dict, micro: dict[str, list[dict]], path: Path) -> None:
    """Static top-K curves (dashed), the paper's window as stars (one per W_max run), the filled window as a
    line through its W_max runs (diamonds): each at its mean active vocabulary, fill ids included."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = dict(zip(res["categories"] + ["overall"], plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2))
    static = res.get("static_coverage") or {}
    for cat, color in colors.items():
        if static.get(cat):
            ax.plot(static["k"], static[cat], "--", color=color, label=f"static {cat}")
        for method, runs in micro.items():
            pts = sorted((r["summary"][cat]["vocab_mean"], r["summary"][cat]["coverage"]) for r in runs
                         if r["summary"][cat]["coverage"] is not None)
            if not pts:
                continue
            marker, line, name = LOOK[method]
            if method == "microspec-paper":
                ax.scatter(*zip(*pts), marker=marker, s=120, color=color, label=f"{name} {cat}")
            else:
                ax.plot(*zip(*pts), marker=marker, linestyle=line, color=color, label=f"{name} {cat}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft vocabulary size (MicroSpec: mean active)")
    ax.set_ylabel("coverage of the target's tokens")
    ax.set_title("coverage vs vocabulary size: static top-K vs MicroSpec (paper, filled)")
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

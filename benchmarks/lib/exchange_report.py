"""The exchange benchmark's report: ratios to gloo, where the time goes (in words), the plot and the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lib.exchange_worker import SYSTEMS


def add_ratios(rows: list[dict]) -> None:
    """Set every row's ratio_to_gloo (its seconds over gloo's fp32 at the same values and peers) and, for
    p2p_diloco, speedup_vs_hivemind: stock hivemind's time for the same work with the same codec (a vector in, the
    averaged vector out: its copies into and out of the averager included, as in our seconds) over ours, and
    speedup_vs_hivemind_step: stock hivemind's step() alone (its copies excluded) over our whole call."""
    gloo = {(r["values"], r["peers"]): r["seconds"] for r in rows if r["system"] == "gloo"}
    stock = {(r["values"], r["peers"], r.get("codec")): r for r in rows if r["system"] == "hivemind"}
    for row in rows:
        reference = gloo.get((row["values"], row["peers"]))
        row["ratio_to_gloo"] = row["seconds"] / reference if row.get("seconds") and reference else None
        if row["system"] == "p2p_diloco":
            hivemind = stock.get((row["values"], row["peers"], row.get("codec")), {})
            ours = row.get("seconds_whole_call") or row.get("seconds")
            theirs = hivemind.get("seconds_whole_call")
            row["speedup_vs_hivemind"] = theirs / ours if ours and theirs else None
            step = hivemind.get("seconds")
            row["speedup_vs_hivemind_step"] = step / row["seconds"] if row.get("seconds") and step else None


def _phase_line(r: dict) -> str:
    """One hivemind-based row in words: its phases, its ratio to gloo and its CPU by process role."""
    p, cpu = r.get("phases_s", {}), r.get("cpu_s_per_round", {})
    total = sum(cpu.values()) or 1.0
    shares = ", ".join(f"{role} {seconds / total:.0%}" for role, seconds in cpu.items() if seconds / total >= 0.02)
    return (
        f"{r['system']} {r.get('codec', 'fp32')} {r['values'] / 1e6:.0f}M values x {r['peers']} peers: "
        f"{r['seconds']:.2f} s/round = "
        f"matchmaking {p.get('matchmaking_s', 0):.2f} s + all-reduce {p.get('allreduce_s', 0):.2f} s "
        f"({r.get('ratio_to_gloo') or float('nan'):.1f}x gloo); CPU {total:.2f} s/round "
        f"({r.get('cpu_busy_fraction', 0):.0%} of all cores): {shares}"
    )


def _profile_lines(row: dict, prof: dict) -> list[str]:
    """What the profilers of one profiled run found, in words."""
    head = f"profile {row['system']} {row['values'] / 1e6:g}M x {row['peers']}"
    if row.get("error"):
        return [f"{head}: failed: {row['error']}"]
    lines = []
    perf = prof.get("perf")
    if perf:
        lines.append(
            f"{head}, perf, CPU samples by process (kernel part): "
            + ", ".join(
                f"{role} {share:.0%} ({perf['kernel_share_by_process'][role]:.0%})"
                for role, share in perf["share_by_process"].items()
            )
        )
        for role in ("averager", "p2pd", "main"):
            tops = perf["top_symbols"].get(role, [])[:6]
            if tops:
                lines.append(f"{head}, perf, hottest in {role}: " + "; ".join(f"{n} {s:.0%}" for n, s in tops))
    spy = prof.get("py_spy_averager")
    if spy:
        lines.append(
            f"{head}, py-spy, averager process on-CPU Python stacks: "
            + ", ".join(f"{name} {share:.0%}" for name, share in spy["categories"].items())
        )
    return lines


def profile_summary(rows: list[dict], profile_rows: list[dict]) -> dict:
    """Where the time of the hivemind-based paths goes, in numbers and in words."""
    measured = [r for r in rows if r["system"] != "gloo" and r.get("seconds")]
    phases = {
        f"{r['system']} {r.get('codec', 'fp32')} {r['values'] // 1_000_000}M x{r['peers']}": {
            "seconds": r.get("seconds"),
            **r.get("phases_s", {}),
            "cpu_s_per_round": r.get("cpu_s_per_round"),
        }
        for r in measured
    }
    lines = [_phase_line(r) for r in measured]
    result: dict[str, Any] = {"phases": phases, "summary": lines, "profiled_runs": []}
    for row in profile_rows:
        prof = row.get("profile") or {}
        result["profiled_runs"].append(
            {
                "system": row["system"],
                "values": row["values"],
                "peers": row["peers"],
                "seconds_under_profilers": row.get("seconds"),
                "correct": row.get("correct"),
                "cpu_s_per_round": row.get("cpu_s_per_round"),
                **prof,
            }
        )
        lines += _profile_lines(row, prof)
    return result


def versions() -> dict:
    """Installed versions of torch, hivemind and p2p-diloco."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "hivemind", "p2p-diloco"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def plot(rows: list[dict], path: Path) -> None:
    """Seconds per round and effective GB/s per configuration, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["values"], r["peers"]) for r in rows})
    labels = [f"{values / 1e6:g}M values\n{peers} peers" for values, peers in configs]
    by_key = {(r["values"], r["peers"], r["system"], r.get("codec", "fp32")): r for r in rows}
    series = sorted({(r["system"], r.get("codec", "fp32")) for r in rows}, key=lambda s: (s[1], SYSTEMS.index(s[0])))
    colors = {"gloo": "tab:green", "hivemind": "tab:orange", "p2p_diloco": "tab:blue"}
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for axis, key, title in (
        (axes[0], "seconds", "seconds per round, log scale (lower is better)"),
        (axes[1], "gb_per_s", "effective GB/s = values x 4 B / seconds (higher is better)"),
    ):
        for offset, (system, codec) in enumerate(series):
            xs = [i + (offset - (len(series) - 1) / 2) * width for i in range(len(configs))]
            heights = [(by_key.get((v, p, system, codec)) or {}).get(key) or 0 for v, p in configs]
            hatch = None if codec == "fp32" else "//"
            bars = axis.bar(xs, heights, width, label=f"{system} {codec}", color=colors[system], hatch=hatch)
            if key == "seconds":
                for bar, (v, p) in zip(bars, configs):
                    ratio = (by_key.get((v, p, system, codec)) or {}).get("ratio_to_gloo")
                    if ratio and system != "gloo":
                        axis.annotate(
                            f"{ratio:.1f}x",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center",
                            va="bottom",
                            fontsize=8,
                        )
        axis.set_xticks(range(len(configs)), labels, fontsize=9)
        axis.set_title(title, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    # Where a round of the hivemind-based paths goes: matchmaking, then the all-reduce.
    axis, width2 = axes[2], 0.35
    for offset, system in enumerate(("hivemind", "p2p_diloco")):
        xs = [i + (offset - 0.5) * width2 for i in range(len(configs))]
        phases = [((by_key.get((v, p, system, "fp32")) or {}).get("phases_s") or {}) for v, p in configs]
        match = [ph.get("matchmaking_s", 0) for ph in phases]
        reduce_ = [ph.get("allreduce_s", 0) for ph in phases]
        axis.bar(xs, match, width2, color=colors[system], alpha=0.45, label=f"{system}: matchmaking")
        axis.bar(xs, reduce_, width2, bottom=match, color=colors[system], label=f"{system}: all-reduce")
    axis.set_xticks(range(len(configs)), labels, fontsize=9)
    axis.set_title("phases of an fp32 round, seconds (mean over peers)", fontsize=10)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    axes[0].legend(fontsize=9)
    fig.suptitle("Averaging a flat fp32 vector on 127.0.0.1, fp32 and int8 on the wire (labels: x gloo fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    """One line per row: seconds per round, GB/s, ratio to gloo, phases, correctness."""
    print(
        f"{'values':>8} {'peers':>5} {'system':>11} {'codec':>5} {'s/round':>8} {'GB/s':>6} {'x gloo':>7} {'match':>6} "
        f"{'allred':>6} {'correct':>7}"
    )
    for r in rows:
        p = r.get("phases_s", {})
        seconds = f"{r['seconds']:.3f}" if r.get("seconds") else "fail"
        gbps = f"{r['gb_per_s']:.3f}" if r.get("gb_per_s") else "-"
        ratio = f"{r['ratio_to_gloo']:.1f}" if r.get("ratio_to_gloo") else "-"
        print(
            f"{r['values'] / 1e6:>7g}M {r['peers']:>5} {r['system']:>11} {r.get('codec', 'fp32'):>5} {seconds:>8} "
            f"{gbps:>6} {ratio:>7} "
            f"{p.get('matchmaking_s', 0):>6.2f} {p.get('allreduce_s', 0):>6.2f} {str(r.get('correct')):>7}"
        )

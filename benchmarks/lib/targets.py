"""The "Toward the limits" targets, each read from the result JSONs it is judged on: figure, target, met or not.

`report.py` puts the table at the top of BENCHMARKS.md, so that where the project stands against its anchors is
read in one place and can never disagree with the tables below it (every figure comes from the same files).
A target whose result file is missing is left out.
"""

from __future__ import annotations

from collections.abc import Callable

Row = tuple[str, str, str, bool]
"""(figure, ours, target, met)."""


def _ratio_list(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def _exchange(data: dict) -> list[Row]:
    rows, out = data["rows"], []
    for codec in ("fp32", "int8"):
        ours = [r for r in rows if r["system"] == "p2p_diloco" and r["codec"] == codec]
        speedups = [r["speedup_vs_hivemind"] for r in ours if r.get("speedup_vs_hivemind")]
        if speedups:
            out.append(
                (
                    f"exchange {codec}: speed-up over stock hivemind (10M/50M x 2/4 peers)",
                    _ratio_list(speedups),
                    ">= 2x",
                    min(speedups) >= 2.0,
                )
            )
    gloo = {(r["values"], r["peers"]): r["seconds"] for r in rows if r["system"] == "gloo"}
    for codec in ("fp32", "int8"):
        shares = [
            gloo[(r["values"], r["peers"])] / r["seconds"]
            for r in rows
            if r["system"] == "p2p_diloco" and r["codec"] == codec and (r["values"], r["peers"]) in gloo
        ]
        if shares:
            out.append(
                (f"exchange {codec}: gloo fp32's time / ours", _ratio_list(shares), ">= 0.25", min(shares) >= 0.25)
            )
    return out


def _link(data: dict) -> list[Row]:
    out = []
    for codec in ("fp32", "int8", "int4"):
        ratios = [
            r["ratio_to_limit"]
            for r in data["rows"]
            if r.get("system", "p2p_diloco") == "p2p_diloco" and r["codec"] == codec and r["rate_mbit"] == 100
        ]
        if ratios:
            out.append(
                (
                    f"round on 100 Mbit/s, {codec}: time / (bytes / bandwidth), 2 and 4 islands",
                    _ratio_list(ratios),
                    "<= 1.25",
                    max(ratios) <= 1.25,
                )
            )
    return out


def _bandwidth(data: dict) -> list[Row]:
    steady = data.get("tcp_over_payload_steady", {})
    out = [
        ("TCP / payload at steady state, " + codec, f"{value:.2f}", "<= 1.5", value <= 1.5)
        for codec, value in steady.items()
        if codec in ("fp32", "int8", "int4", "int2", "topk")
    ]
    ratio, loss = data.get("ratio_vs_data_parallel", {}), data.get("final_eval_loss", {})
    if "topk" in ratio:
        out.append(
            ("topk: bytes vs data-parallel at H=100", f"{ratio['topk']:,.0f}x", ">= 10,000x", ratio["topk"] >= 10_000)
        )
    if "topk" in loss and "fp32" in loss:
        over = loss["topk"] / loss["fp32"] - 1
        out.append(
            ("topk: final eval vs fp32 (3 seeds, 2 rounds at H=100)", f"{over:+.1%}", "within 1%", abs(over) <= 0.01)
        )
    return out


def _chaos(data: dict) -> list[Row]:
    goodput = data["goodput"]["decoupled"]
    out = [("goodput under chaos, decoupled", f"{goodput:.2f}", ">= 0.90", goodput >= 0.90)]
    phases = data.get("restart_breakdown_mean_s", {}).get("decoupled", {})
    if phases.get("restore_s") and phases.get("total_s"):
        times = phases["total_s"] / phases["restore_s"]
        out.append(("restart to first merge / state transfer (chaos)", f"{times:.1f}x", "<= 2x", times <= 2))
    return out


def _simulator(data: dict) -> list[Row]:
    rows = data.get("paper_comparison", [])
    if not rows:
        return []
    worst = max(abs(r["ours"] - r["paper"]) * 100 for r in rows)
    stated = len(data.get("paper_comparison_setting", {}).get("assumptions_that_differ", []))
    shown = f"{worst:.1f} points" + (f" ({stated} differing assumptions stated)" if stated else "")
    return [
        (
            f"simulator vs the paper's goodput table (worst of {len(rows)})",
            shown,
            "<= 3 points, or each differing assumption stated",
            worst <= 3 or stated > 0,
        )
    ]


def _quality(data: dict) -> list[Row]:
    ratio, spread = data["p2p_vs_dp_ratio"], data.get("p2p_vs_dp_ratio_spread", {})
    seeds = len(data.get("seeds", [0]))
    shown = f"{ratio:.3f} ({seeds} seeds, {spread.get('min', ratio):.3f}-{spread.get('max', ratio):.3f})"
    return [("quality: p2p-diloco / data-parallel eval loss", shown, "<= 1.02, 3 seeds", ratio <= 1.02 and seeds >= 3)]


def _bench_times(data: dict) -> list[Row]:
    minutes = data["total_s"] / 60
    return [
        (f"`make bench` ({data.get('mode', 'full')}) on 2 cores", f"{minutes:.0f} min", "about 45 min", minutes <= 50)
    ]


JUDGES: list[tuple[str, Callable[[dict], list[Row]]]] = [
    ("exchange", _exchange),
    ("link", _link),
    ("bandwidth", _bandwidth),
    ("chaos", _chaos),
    ("simulator", _simulator),
    ("quality", _quality),
    ("bench_times", _bench_times),
]
"""Result file (without .json) and the function that reads its targets."""


def target_rows(results: dict[str, dict]) -> list[list]:
    """Table rows [figure, ours, target, met] for every target whose result file is in `results`."""
    rows = []
    for name, judge in JUDGES:
        if name in results:
            rows += [
                [figure, ours, target, "yes" if met else "no"] for figure, ours, target, met in judge(results[name])
            ]
    return rows

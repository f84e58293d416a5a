"""BENCHMARKS.md sections on failures: goodput under chaos, and one restart on an idle machine."""

from __future__ import annotations

from lib.markdown import fmt, table


def chaos(data: dict) -> str:
    """Goodput under failures."""
    carried = data.get("carried_over", {})
    rows = [
        [
            mode
            + (
                f" (carried over from the result of {carried[mode][:10]}; make bench-all reruns it)"
                if mode in carried
                else ""
            ),
            data["goodput"][mode],
            ", ".join(fmt(x, 3) for x in data.get("goodput_pairs", {}).get(mode, [])) or "-",
            data.get("goodput_speed_normalized", {}).get(mode, "-"),
            data["final_eval_loss"][mode],
            ", ".join(fmt(x, 1) for x in data["restart_to_first_merge_s"][mode]) or "-",
            data.get("restarts_killed_before_merging", {}).get(mode, "-"),
            "; ".join(data["unexpected_errors"][mode]) or "none",
        ]
        for mode in data["goodput"]
    ]
    header = ["mode", "goodput (vs no faults)", "each pair of runs", "weighed by step time", "final eval loss"]
    header += ["restart → first merge (s)"]
    header += ["restarts killed again before merging", "unexpected errors"]
    text = table(header, rows)
    if "cpu_quota" in data:
        cpus = data.get("island_cpus")
        text = (
            f"CPU per island: {'unlimited' if cpus is None else fmt(cpus, 2) + ' cores'} ({data['cpu_quota']})\n\n"
            + text
        )
    shares, phases = data.get("goodput_breakdown", {}), data.get("restart_breakdown_mean_s", {})
    if shares:
        keys = ("schedule_downtime", "restart_startup", "lost_at_kills", "extra_waiting", "other")
        keys += ("goodput_of_available",)
        text += "\n\nWhere the clean run's tokens went (shares of islands × budget):\n\n"
        text += table(["mode", *keys], [[mode, *(shares[mode].get(key) for key in keys)] for mode in shares])
    if phases:
        keys = ("process_start_s", "join_s", "restore_s", "first_round_s", "total_s")
        text += "\n\nA restart, mean seconds per phase until the island's first merged round:\n\n"
        text += table(["mode", *keys], [[mode, *(fmt(phases[mode].get(key), 1) for key in keys)] for mode in phases])
    return text


def restart(data: dict) -> str:
    """A restart beside one training island, with and without the start-up shortcuts."""
    keys = ("import_s", "process_start_s", "join_s", "restore_s", "first_round_s", "total_s", "total_over_restore")
    median = data["median_s"]
    text = "Median seconds per phase of a restarted island until its first merged round:\n\n"
    text += table(["way", *keys], [[way, *(fmt(median[way].get(key), 2) for key in keys)] for way in median])
    ratios = data["shipped_over_plain"]
    text += "\n\nshipped / plain: " + ", ".join(f"{key} {fmt(value, 3)}" for key, value in ratios.items())
    if "standby_over_shipped" in data:
        standby = data["standby_over_shipped"]
        text += "; standby / shipped: " + ", ".join(f"{key} {fmt(value, 3)}" for key, value in standby.items())
    return text


def restart_link(data: dict) -> str:
    """A restart whose state transfer crosses a shaped link, per model size and codec."""
    keys = ("process_start_s", "join_s", "restore_s", "anchor_s", "first_round_s", "total_s")
    ratios = ("total_over_restore", "total_over_transfer_limit", "second_downloads")
    text = (
        f"Each island's uplink is shaped to {data['rate_mbit']:g} Mbit/s; the outer state (anchor and momentum, "
        "fp32) takes `transfer_limit_s` at that rate. Median seconds per phase of the restarted island until its "
        "first merged round (`anchor_s`: how far into `restore_s` the anchor was in and the first round's inner "
        "steps began, while the rest of the state downloaded; `second_downloads`: restarts whose first merge found "
        "them a step behind, so that they downloaded the state again):\n\n"
    )
    rows = [
        [label, f"{figures['state_bytes'] / 1e6:.0f} MB", fmt(figures["transfer_limit_s"], 2)]
        + [fmt(figures.get(key), 2) for key in (*keys, *ratios)]
        for label, figures in data["configs"].items()
    ]
    text += table(["model, codec", "state", "transfer_limit_s", *keys, *ratios], rows)
    carried = data.get("carried_over", {})
    if carried:
        text += "\n\nCarried over from the last --extended run: " + ", ".join(f"{k} ({v})" for k, v in carried.items())
    return text

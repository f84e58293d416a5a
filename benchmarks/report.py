"""Writes BENCHMARKS.md from the latest benchmarks/results/*.json, with the command and machine of each.

python benchmarks/report.py
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from lib.markdown import fmt, table
from lib.report_failures import chaos, restart, restart_link
from lib.targets import target_rows

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def quality(data: dict) -> str:
    """Quality vs data-parallel."""
    losses, spread = data["final_eval_loss"], data.get("final_eval_loss_spread", {})
    systems = ("data_parallel", "p2p_diloco", "isolated", "single")
    rows = [
        [system, losses.get(system), spread.get(system, {}).get("std"), *_range(spread.get(system))]
        for system in systems
    ]
    seeds = data.get("seeds", [data.get("settings", {}).get("seed", 0)])
    ran = data.get("seeds_by_system", {})
    carried = data.get("carried_over", {})
    for row in rows:
        name = row[0]
        if ran.get(name, seeds) != seeds:
            row[0] = f"{row[0]} (seeds {ran[name]})"
        if name in carried:
            row[0] += f", carried over from {carried[name][:10]} (make bench-all reruns it)"
    text = table([f"system (mean of {len(seeds)} seed(s))", "final eval loss", "std", "min", "max"], rows)
    if losses.get("data_parallel") and losses.get("p2p_diloco"):
        text += f"\n\np2p-diloco / data-parallel: {losses['p2p_diloco'] / losses['data_parallel']:.4f}"
        by_seed = data.get("p2p_vs_dp_ratio_by_seed")
        if by_seed and len(by_seed) > 1:
            text += " (by seed: " + ", ".join(f"{ratio:.4f}" for ratio in by_seed) + ")"
    return text


def _range(spread: dict | None) -> list:
    return [None, None] if not spread else [spread["min"], spread["max"]]


def exchange(data: dict) -> str:
    """Exchange speed vs gloo and stock hivemind."""
    rows = [
        [
            row["values"],
            row["peers"],
            row["system"],
            row.get("codec", "fp32"),
            row["seconds"],
            row.get("gb_per_s"),
            row.get("ratio_to_gloo"),
            row.get("seconds_whole_call"),
            row.get("speedup_vs_hivemind"),
            row.get("speedup_vs_hivemind_step"),
        ]
        for row in data["rows"]
    ]
    header = ["values", "peers", "system", "codec", "seconds/round", "GB/s", "x gloo fp32", "vector to vector s"]
    header += ["speedup vs hivemind", "vs hivemind's step alone"]
    text = table(header, rows)
    if any(row.get("speedup_vs_hivemind_step") for row in data["rows"]):
        text += (
            "\n\nseconds/round: gloo's all_reduce after a barrier; hivemind's step() alone; ours the whole "
            "GossipExchange.average() call, its copy in and copy out included. Vector to vector: each peer's vector "
            "in, the averaged vector out in a buffer kept across rounds, copies included on every side. The speed-up "
            "over stock hivemind compares that same work; the last column, hivemind's step() alone against our "
            "whole call."
        )
    costs = data.get("codec_ms_per_million")
    if costs:
        text += "\n\nCodec CPU on one core, ms per million values: " + ", ".join(
            f"{name} encode {cost['encode']:.1f} / decode {cost['decode']:.1f}" for name, cost in costs.items()
        )
        estimates = [r for r in data["rows"] if r["system"] == "p2p_diloco" and r.get("codec_s_estimate")]
        text += ". One peer's codec work per round at those rates: " + ", ".join(
            f"{r['values'] / 1e6:g}M x {r['peers']} {r['codec']} {r['codec_s_estimate']:.2f} s of {r['seconds']:.2f} s"
            for r in estimates
        )
    return text


def link(data: dict) -> str:
    """Seconds per round on shaped links against bytes / bandwidth."""
    rows = [
        [
            row["rate_mbit"],
            row["islands"],
            row["system"] + (" (unpaced)" if row.get("paced") is False else ""),
            row["codec"],
            row["payload_bytes"] / 1e6,
            row["seconds_per_round"],
            row["limit_s"],
            row["ratio_to_limit"],
            row.get("wire_over_sent"),
        ]
        for row in data["rows"]
    ]
    header = ["Mbit/s", "islands", "system", "codec", "payload MB", "s/round", "limit s", "x limit", "wire / sent"]
    return table(header, rows)


def decoupled(data: dict) -> str:
    """Decoupled merging under heterogeneity."""
    rows, carried = [], data.get("carried_over", {})
    for row in data["rows"]:
        finals = ", ".join(fmt(v, 3) for v in row["final_eval_loss"].values())
        when = carried.get(row["name"])
        rows.append(
            [
                row["name"] + (f" (carried over from {when[:10]}; make bench-all reruns it)" if when else ""),
                row["mode"],
                row["merge"],
                row["mean_final_eval_loss"],
                finals,
                row["goodput"],
                row["blocked_fraction"],
            ]
        )
    text = table(["config", "mode", "merge", "mean final eval", "per island", "goodput tok/s", "blocked"], rows)
    if "targets" in data:
        targets = data["targets"]
        text += (
            f"\n\nadaptive goodput / K=1 no-grace goodput: {targets['adaptive_goodput_vs_k1_no_grace']:.3f}; "
            f"adaptive eval − synchronous eval: {targets['adaptive_eval_minus_sync_eval']:+.4f}"
        )
    return text


def simulator(data: dict) -> str:
    """Simulated goodput at scale."""
    columns = sorted({(row["method"], row["islands"]) for row in data["rows"]})
    chips = sorted({row["chips"] for row in data["rows"]})
    lookup = {(row["chips"], row["method"], row["islands"]): row["goodput"] for row in data["rows"]}
    header = ["chips"] + [f"{method} M={islands}" for method, islands in columns]
    rows = [[f"{c:,}"] + [lookup.get((c, m, i)) for m, i in columns] for c in chips]
    text = table(header, rows)
    if "paper" in data:
        text += f"\n\npaper: {json.dumps(data['paper'])}"
    if "paper_comparison" in data:
        setting = data["paper_comparison_setting"]
        rows = [
            [f"{r['chips']:,}", r["system"], r["islands"], r["ours"], r["paper"], r["difference_points"]]
            for r in data["paper_comparison"]
        ]
        text += (
            f"\n\nThe paper's table with elastic learners (reconfig_s {setting['reconfig_s']:.1f} s, calibrated to "
            f"{setting['calibrated_to']}):\n\n"
            + table(["chips", "system", "M", "ours", "paper", "points"], rows)
            + "\n\nAssumptions that differ:\n\n"
            + "\n".join(f"- {line}" for line in setting["assumptions_that_differ"])
        )
    return text


def bandwidth(data: dict) -> str:
    """Bytes per token vs data-parallel, per H and codec, and the codecs' final eval loss."""
    by_h = data.get("by_H") or {str(data.get("H")): data}
    rows = []
    for h, block in by_h.items():
        for codec, ratio in block["ratio_vs_data_parallel"].items():
            rows.append(
                [
                    h,
                    codec,
                    ratio,
                    block.get("transport_ratio_vs_data_parallel", {}).get(codec),
                    block.get("tcp_over_payload", {}).get(codec),
                    block.get("tcp_over_payload_steady", {}).get(codec),
                    block.get("final_eval_loss", {}).get(codec),
                ]
            )
    header = [
        "H",
        "codec",
        "payload: x less than data-parallel",
        "TCP: x less",
        "TCP / payload",
        "TCP / payload, steady state",
        "final eval loss",
    ]
    seeds = data.get("seeds")
    note = (
        "\n\nTCP / payload counts from each island's start (join and first matchmaking included); the steady state "
        "from the end of its first round."
    )
    for codec, wide in (data.get("tcp_over_payload_steady_wide") or {}).items():
        note += (
            f" On a 4x wider model ({wide['parameters'] / 1e6:.1f}M parameters) {codec}'s TCP / payload at steady "
            f"state is {wide['tcp_over_payload_steady']:.2f}: {wide['payload_bytes_per_round'] / 1000:.1f} KB of "
            f"payload and {wide['chatter_bytes_per_round'] / 1000:.1f} KB of chatter per island and round."
        )
    if carried := data.get("carried_over"):
        dates = sorted({date[:10] for date in carried.values() if date})
        note += (
            f"\n\n{', '.join(carried)}: carried over from the previous result (dated {', '.join(dates)}); "
            "`make bench` skips them, `make bench-all` reruns them."
        )
    return (f"H = {data.get('H')} rows are means over seeds {seeds}.\n\n" if seeds else "") + table(header, rows) + note


def sparse_horizon(data: dict) -> str:
    """Eval loss per round of topk against fp32 (each outer optimizer), and how many rounds topk trails the better."""
    curves, behind = data["eval_loss_by_round"], data["topk_rounds_behind"]
    reference = data.get("fp32_reference", "fp32")
    systems = [system for system in ("fp32", "fp32_sgd", "topk") if system in curves]
    rows = [
        [
            index + 1,
            *(curves[system][index] for system in systems),
            curves["topk"][index] / curves[reference][index],
            lag,
        ]
        for index, lag in enumerate(behind)
    ]
    seeds = data.get("seeds", [data.get("seed")])
    finals, spread = data["final_eval_loss"], data.get("final_eval_spread", {})
    outer = data.get("outer", {})
    described = "; ".join(f"{system}: lr {o['lr']}, momentum {o['momentum']}" for system, o in outer.items())
    return (
        f"{data['islands']} islands, H = {data['H']}, {data['model']} model, mean of seeds {seeds}, in one process "
        "with the swarm's codec, error feedback and merge"
        + (
            f"; outer optimizers {described}; topk's residual faded by {data['error_feedback_decay']} a round"
            if outer
            else ""
        )
        + ".\n\n"
        + table(
            [
                "round",
                *(f"{system} eval" for system in systems),
                f"topk / {reference}",
                f"rounds behind {reference} (negative: ahead; empty: it never got this low)",
            ],
            rows,
        )
        + f"\n\nFinal eval after {data['rounds']} rounds (spread over seeds): "
        + ", ".join(f"{system} {finals[system]:.4f} ({spread.get(system, 0):.4f})" for system in systems)
        + f"; topk / {reference} {data['topk_over_fp32']:.3f} on average, by seed "
        + ", ".join(f"{r:.3f}" for r in data.get("topk_over_fp32_by_seed", [data["topk_over_fp32"]]))
        + "."
    )


def chatter(data: dict) -> str:
    """Chatter per island-round by what it served, and the top-k payload beside it."""
    walks = data.get("hivemind_walks", {})
    theirs = walks.get("chatter_by_what", {})
    names = list(dict.fromkeys([*data["chatter_by_what"], *theirs]))
    rows = [[what, data["chatter_by_what"].get(what, 0.0) / 1000, theirs.get(what, 0.0) / 1000] for what in names]
    rows.append(
        ["all RPCs", data["rpc_bytes_per_island_round"] / 1000, walks.get("rpc_bytes_per_island_round", 0) / 1000]
    )
    rows.append(
        [
            "top-k payload (direct lanes)",
            data["payload_bytes_per_island_round"] / 1000,
            walks.get("payload_bytes_per_island_round", 0) / 1000,
        ]
    )
    ratio = data.get("replica_first_vs_walks")
    return (
        f"{data['islands']} islands, tiny model, top-k, quorum {data['islands']}; {data['island_rounds_counted']} "
        "island-rounds at steady state; protobuf bytes of each RPC, request and response, at its caller; beside "
        "them the same swarm with `--dht-walk-every 1` (every DHT read and write walks, as hivemind does)"
        + (f": replica-first / walks = {ratio:.2f}" if ratio else "")
        + ".\n\n"
        + table(["what", "KB per island-round", "every op walks"], rows)
    )


def utilization(data: dict) -> str:
    """Compute fraction on a slow link, blocking vs streaming."""
    rows = [[mode, fraction] for mode, fraction in data["compute_fraction"].items()]
    setup = data.get("link_setup")
    return (
        f"link: {data['link']} ({'; '.join(setup) if isinstance(setup, list) else setup}); H = {data.get('H')}, "
        f"streaming P = {data.get('fragments')}, τ = {data.get('overlap_steps')}\n\n"
        + table(["mode", "fraction of wall-clock computing"], rows)
    )


def attacks(data: dict) -> str:
    """One row per attack, and what the defences cost a clean swarm."""
    from attacks import table

    cost = data["defence_cost"]
    return (
        table(data["rows"])
        + f"\n\nDefences on a clean swarm: {cost['round_s_on']:.2f} s vs {cost['round_s_off']:.2f} s per round "
        f"(x{cost['slowdown']:.2f}), final eval {cost['eval_on']:.4f} vs {cost['eval_off']:.4f}."
    )


def internet(data: dict) -> str:
    """Join time and seconds per round, direct vs relayed islands on separate hosts."""
    rows = []
    for name in ("direct", "relayed"):
        figures = data[name]["summary"]
        rows.append([name, figures["join_s"], figures["first_record_s"], figures["round_s"], figures["merged_rounds"]])
    ratios = data["ratios"]
    return (
        table(["islands", "join s", "first record s", "s per round", "merged rounds"], rows)
        + f"\n\nRelayed / direct: join x{ratios['join_relayed_over_direct']:.2f}, "
        f"seconds per round x{ratios['round_relayed_over_direct']:.2f}."
    )


def throughput(data: dict) -> str:
    """Island against a plain loop, the outer step by model size, and the GPU figures when there were any."""
    text = (
        f"Island / plain loop (tiny Llama, CPU, H = 50, outer step included): **{data['ratio_vs_plain_loop']:.3f}**\n\n"
        + table(
            ["parameters", "outer step ms"], [[f"{r['params'] / 1e6:.1f}M", r["outer_step_ms"]] for r in data["rows"]]
        )
    )
    gpu = data.get("gpu")
    if not gpu:
        return text + "\n\nNo GPU on the machine that ran it: no GPU figures."
    rows = [
        [name, gpu[f"{name}_tokens_per_s"], gpu[f"{name}_mfu"], gpu["peak_memory_gb"]] for name in ("island", "plain")
    ]
    return (
        text
        + f"\n\n{gpu['gpu']}, 150M-shaped Llama, bf16:\n\n"
        + table(["loop", "tokens/s", "MFU", "peak memory GB"], rows)
    )


def ranks(data: dict) -> str:
    """Tokens/s by island layout, and the outer step's cost with ranks by model size."""
    base = table(
        ["island", "tokens/s", "x one thread"],
        [[label, rate, data["speedup_vs_one_thread"][label]] for label, rate in data["tokens_per_s"].items()],
    )
    single = {row["size"]: row["ms"] for row in data["outer_step_ms"]["1 process"]}
    rows = []
    for name, layout in data["outer_step_ms"].items():
        rows += [[name, f"{r['params'] / 1e6:.1f}M", r["ms"], r["ms"] / single[r["size"]]] for r in layout]
    cores = data.get("cpu_count")
    outer = table(["island", "parameters", "ms", "x one process"], rows)
    return (
        f"Inner steps ({cores} CPU cores):\n\n{base}\n\n"
        f"One outer step on rank 0 (weights out, Nesterov, weights into every rank):\n\n{outer}"
    )


SECTIONS: list[tuple[str, str, Callable[[dict], str]]] = [
    ("quality", "Quality vs data-parallel", quality),
    ("exchange", "Exchange speed", exchange),
    ("link", "Rounds on shaped links", link),
    ("chaos", "Goodput under failures", chaos),
    ("restart", "A restart beside one training island", restart),
    ("restart_link", "A restart over a 100 Mbit/s link", restart_link),
    ("simulator", "Simulated goodput at scale", simulator),
    ("decoupled", "Decoupled merging with a 3x slower island", decoupled),
    ("bandwidth", "Bandwidth vs data-parallel", bandwidth),
    ("sparse_horizon", "Top-k against fp32 over more rounds", sparse_horizon),
    ("chatter", "Where the chatter goes", chatter),
    ("utilization", "Compute utilization on a slow link", utilization),
    ("attacks", "Attacks on a swarm, defences off and on", attacks),
    ("internet", "Direct vs relayed islands on separate hosts", internet),
    ("throughput", "Island throughput against a plain training loop", throughput),
    ("ranks", "Islands of several ranks", ranks),
]


def _times() -> list[str]:
    """How long the last `make bench` took, script by script (scripts/run_benchmarks.py's bench_times.json)."""
    path = RESULTS / "bench_times.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    rows = [[entry["script"], round(entry["seconds"]), entry["rc"]] for entry in data["scripts"]]
    rows.append(["total", round(data["total_s"]), None])
    return [
        "",
        "## How long `make bench` took",
        "",
        f"{data.get('date', '?')}, {data.get('mode', 'full')} mode, one script at a time:",
        "",
        table(["script", "seconds", "exit code"], rows),
        *(
            [f"\nNot run by `make bench` (`make bench-all` adds them): {', '.join(data['not_run'])}."]
            if data.get("not_run")
            else []
        ),
        *([f"\n{data['note']}"] if data.get("note") else []),
    ]


def _targets() -> list[str]:
    """The issue's targets against the figures of the result files below: met or not, and why not."""
    results = {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS.glob("*.json"))}
    rows = target_rows(results)
    if not rows:
        return []
    met = sum(row[3] == "yes" for row in rows)
    return [
        "",
        "## Where the targets stand",
        "",
        f'The targets of "Toward the limits", read from the result files below: {met} of {len(rows)} met; for each '
        "one not met, what stands in the way, in figures from the same files.",
        "",
        table(["figure", "ours", "target", "met", "what stands in the way"], rows),
    ]


def main() -> int:
    """Regenerate BENCHMARKS.md."""
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; rerun them with "
        "`make bench` (all but the attack table, which `make bench-all` adds; `make bench-quick` for a smaller run). "
        "Each table names the command that produced it, its date and the machine. "
        "These machines are shared and noisy: compare rows of one table, not absolute times across tables.",
    ]
    parts += _targets()
    for name, title, render in SECTIONS:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        parts += [
            "",
            f"## {title}",
            "",
            f"`{data.get('command', '?')}` — {data.get('date', '?')} — {json.dumps(data.get('machine', {}))}",
            "",
            render(data),
        ]
        if (RESULTS / f"{name}.png").exists():
            parts += ["", f"![{title}](benchmarks/results/{name}.png)"]
    parts += _times()
    (REPO / "BENCHMARKS.md").write_text("\n".join(parts) + "\n")
    print(f"wrote {REPO / 'BENCHMARKS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Attacks on a swarm: what honest islands end with, defences off and on, against an all-honest swarm.

One row per attack (benchmarks/lib/attack_runs.py): two honest islands of the tiny model and a hostile third for
the merge attacks; a late honest island with a lying donor for the donor attacks; three honest islands beside a
forged DHT record for the record attacks. "Defences off" is `--robust-merge none --ban-rounds 0`; the record,
clock and state checks cannot be switched off, so for those rows both columns are the defended run. Also the
cost of the defences on a clean swarm: seconds per round and final eval loss, robust merge on vs off.

    python benchmarks/attacks.py            # every attack, the forged records in one swarm (about 11 minutes)
    python benchmarks/attacks.py --quick    # two attacks (a NaN merge, a forged step record)
    python benchmarks/attacks.py --smoke    # one attack, defended only (used by the tests)
"""

from __future__ import annotations

import statistics
from pathlib import Path

from lib.attack_runs import (
    DONOR_ATTACKS,
    FORGED_RECORDS,
    MERGE_ATTACKS,
    donor_attack,
    forged_record,
    merge_attack,
    named,
)
from lib.common import benchmark_parser, provenance, write_result

QUICK = ["nan", "record-step"]
SMOKE = ["nan"]


def row(name: str, folder: Path, baseline: float, both: bool = True, records: dict | None = None) -> dict:
    """Run one attack (defended, and with `both` undefended too where defences can be switched off); a forged
    record's row comes out of `records`, the one swarm run beside every forged record, when given."""
    print(f"attack {name} ...", flush=True)
    if records is not None and name in FORGED_RECORDS:
        defended = undefended = {**records, "detected": named(records["attacker"][name], records["logs"])}
    elif name in MERGE_ATTACKS:
        defended = merge_attack(folder / f"{name}-on", name)
        undefended = merge_attack(folder / f"{name}-off", name, defended=False) if both else None
    elif name in DONOR_ATTACKS:
        defended = donor_attack(folder / f"{name}-on", name)
        undefended = donor_attack(folder / f"{name}-off", name, defended=False) if both else None
    else:
        defended = undefended = forged_record(folder / name, name)
    undefended = undefended or defended
    result = {
        "attack": name,
        "defended_eval": statistics.mean(defended["evals"]),
        "undefended_eval": statistics.mean(undefended["evals"]),
        "baseline_eval": baseline,
        "merged_rounds": min(defended["merged"]),
        "detected": defended["detected"],
        "crashed": defended["crashed"],
        "defences_switchable": both and (name in MERGE_ATTACKS or name in DONOR_ATTACKS),
    }
    print(
        f"  defended {result['defended_eval']:.4f}  undefended {result['undefended_eval']:.4f}  baseline "
        f"{baseline:.4f}  merged {result['merged_rounds']}  detected {result['detected']}",
        flush=True,
    )
    return result


def defence_cost(folder: Path) -> dict:
    """A clean swarm with the robust merge on and off: seconds per round and final eval."""
    on, off = merge_attack(folder / "clean-on", None), merge_attack(folder / "clean-off", None, defended=False)
    return {
        "round_s_on": on["round_s"],
        "round_s_off": off["round_s"],
        "slowdown": on["round_s"] / off["round_s"] if on["round_s"] and off["round_s"] else None,
        "eval_on": statistics.mean(on["evals"]),
        "eval_off": statistics.mean(off["evals"]),
    }


def table(rows: list[dict]) -> str:
    """The attacks as a markdown table."""
    lines = [
        "| attack | honest eval, defences off | defences on | clean baseline | rounds merged | attacker named |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        off = f"{r['undefended_eval']:.4f}" if r["defences_switchable"] else "(always on)"
        lines.append(
            f"| {r['attack']} | {off} | {r['defended_eval']:.4f} | {r['baseline_eval']:.4f} | "
            f"{r['merged_rounds']} | {'yes' if r['detected'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the attacks, print the table, write attacks.json."""
    args = benchmark_parser(__doc__, quick="two attacks").parse_args(argv)
    names = SMOKE if args.smoke else QUICK if args.quick else [*MERGE_ATTACKS, *DONOR_ATTACKS, *FORGED_RECORDS]
    folder = args.out / "attacks-runs"
    cost = defence_cost(folder)
    baseline = cost["eval_on"]
    # The record checks cannot be switched off and every forger is its own DHT node: one swarm beside all the
    # forged records at once names each forger (or not) as five swarms would, in a fifth of the time.
    forged = [name for name in names if name in FORGED_RECORDS]
    records = None
    if len(forged) > 1:
        print(f"one swarm beside every forged record ({', '.join(forged)}) ...", flush=True)
        records = forged_record(folder / "records", forged)
        records["attacker"] = dict(zip(forged, records["attacker"]))
    rows = [row(name, folder, baseline, both=not args.smoke, records=records) for name in names]
    print(table(rows))
    print(
        f"defences on a clean swarm: {cost['round_s_on']:.2f} s vs {cost['round_s_off']:.2f} s per round "
        f"(x{cost['slowdown']:.2f}), eval {cost['eval_on']:.4f} vs {cost['eval_off']:.4f}"
    )
    result = {**provenance("attacks.py", argv), "rows": rows, "defence_cost": cost}
    print(f"wrote {write_result(args.out, 'attacks', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

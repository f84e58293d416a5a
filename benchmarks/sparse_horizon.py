"""How many rounds codec topk needs to catch up with fp32: eval loss per round of each, at H = 100, 4 islands.

`bandwidth.py` trains 2 rounds at H = 100, where topk's 2% of each pseudo-gradient (error feedback holding the
rest) cannot have moved the model far: its eval loss there is far above fp32's. This script trains the same
4 islands for more rounds in one process, with the swarm's own pieces (inner AdamW, `topk_sparsify`, the wire
format both ways, `ErrorFeedback`, the reducer re-encoding the merge, the outer optimizers each codec defaults
to: fp32 Nesterov 0.7 / 0.9, topk plain SGD with a faded residual: `SPARSE_DEFAULTS`) and a quorum-4 merge (topk:
each value over the islands that sent it, as `SparsePartReducer`), so that no network time is spent.

    python benchmarks/sparse_horizon.py           # default model, 24 rounds, seeds 0 1 2, 2 at a time (~13 min)
    python benchmarks/sparse_horizon.py --quick   # tiny model, 40 rounds, seeds 0 1 2
    python benchmarks/sparse_horizon.py --smoke   # tiny model, 3 rounds, seed 0 (used by the tests)
    python benchmarks/sparse_horizon.py --systems topk --topk-outer-lr 1.0 --error-feedback-decay 0.8
                                                  # a sweep point: topk alone, the fp32 curves reused (~6 min)
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from lib.common import TINY, benchmark_parser, provenance, write_result

from p2p_diloco.config import SPARSE_DEFAULTS, load_config
from p2p_diloco.diloco.error_feedback import ErrorFeedback
from p2p_diloco.diloco.inner import make_inner_optimizer, run_inner_steps
from p2p_diloco.diloco.merge import sparse_mean
from p2p_diloco.diloco.outer import OuterOptimizer, assign_parameters_, flatten_parameters
from p2p_diloco.diloco.quantize import quantizer
from p2p_diloco.diloco.sparse import topk_sparsify
from p2p_diloco.train.data import BatchStream, data_seed, evaluate, load_shards
from p2p_diloco.train.model import build_model

ISLANDS, H, DENSITY = 4, 100, 0.02
OUTER = {
    "fp32": (0.7, 0.9),
    "fp32_sgd": (1.0, 0.0),
    "topk": (SPARSE_DEFAULTS["train.outer_lr"], SPARSE_DEFAULTS["train.outer_momentum"]),
}
"""Outer optimizer (lr, Nesterov momentum) of each system: fp32 with the swarm's default (the DiLoCo papers'), fp32
with plain SGD at lr 1 (better at this horizon, as quality.py found at its own), topk with its defaults
(p2p_diloco.config.SPARSE_DEFAULTS). topk is judged against the better fp32."""


def train(
    system: str,
    rounds: int,
    seed: int,
    tiny: bool,
    eval_batches: int,
    outer_settings: tuple[float, float] | None = None,
    decay: float | None = None,
) -> list[float]:
    """Eval loss of the anchor after every round of 4 islands of `system` (an OUTER key), with its outer (lr,
    momentum) and topk's error-feedback decay unless given."""
    codec = "topk" if system == "topk" else "fp32"
    config = load_config(TINY if tiny else None)
    shards, seq_len, train_config = load_shards(config.data), config.model.seq_len, config.train
    models = [build_model(config.model, seed=seed) for _ in range(ISLANDS)]
    optimizers = [
        make_inner_optimizer(m, train_config.lr, train_config.weight_decay, train_config.warmup_steps) for m in models
    ]
    streams = [
        BatchStream(shards.train_shard(i, ISLANDS), 8, seq_len, seed=data_seed(seed, i, "")) for i in range(ISLANDS)
    ]
    decay = SPARSE_DEFAULTS["network.error_feedback_decay"] if decay is None else decay
    feedback = [ErrorFeedback(decay) for _ in range(ISLANDS)]
    wire = quantizer(codec)
    lr, momentum = outer_settings or OUTER[system]
    outer = OuterOptimizer(flatten_parameters(models[0].parameters()), lr=lr, momentum=momentum)
    losses = []
    for round_number in range(rounds):
        anchor = outer.anchor.data.clone()
        sent = []
        for model, (optimizer, scheduler), stream, residual in zip(models, optimizers, streams, feedback):
            run_inner_steps(model, optimizer, scheduler, stream.next_batch, H, grad_clip=train_config.grad_clip)
            delta = anchor - flatten_parameters(model.parameters())
            if codec == "topk":
                compensated = residual.compensate(delta)
                delta = wire.round_trip(topk_sparsify(compensated, DENSITY))
                residual.update(delta, compensated)
            sent.append(delta)
        # the reducers' merge (topk: each value over the islands that sent it), sent back encoded
        merged = wire.round_trip(sparse_mean(sent) if codec == "topk" else torch.stack(sent).mean(dim=0))
        new_anchor = outer.step(merged)
        for model in models:
            assign_parameters_(model.parameters(), new_anchor)
        losses.append(evaluate(models[0], shards.eval, seq_len, 8, eval_batches))
        print(f"{system:<8} seed {seed} round {round_number + 1:>3}/{rounds}: eval loss {losses[-1]:.4f}", flush=True)
    return losses


def rounds_behind(sparse: list[float], dense: list[float]) -> list[int | None]:
    """For every round of topk, how many rounds earlier `dense` had reached its loss (None: it never got that low)."""
    behind = []
    for index, loss in enumerate(sparse):
        first = next((r for r, value in enumerate(dense) if value <= loss), None)
        behind.append(None if first is None else index - first)
    return behind


def plot(curves: dict[str, list[float]], settings: dict[str, tuple[float, float]], path) -> None:
    """Eval loss per round, fp32 against topk (`settings`: each system's outer lr and momentum)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for codec, losses in curves.items():
        lr, momentum = settings[codec]
        axes.plot(range(1, len(losses) + 1), losses, marker="o", label=f"{codec} (outer lr {lr}, momentum {momentum})")
    axes.set_xlabel(f"round (H = {H}, {ISLANDS} islands)")
    axes.set_ylabel("eval loss of the anchor")
    axes.set_title("topk (2%, 2-bit, error feedback) against fp32")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _train_job(job: tuple) -> list[float]:
    """One `train` run (its arguments in order) in a worker process of one thread."""
    torch.set_num_threads(1)
    return train(*job)


def train_all(
    rounds: int, seeds: list[int], tiny: bool, workers: int, outer: dict[str, tuple[float, float]], decay: float
) -> dict[int, dict[str, list[float]]]:
    """Eval curves of every system of `outer` (its outer lr and momentum) for every seed, `workers` runs at a time."""
    jobs = [(codec, rounds, seed, tiny, 2 if tiny else 16, outer[codec], decay) for seed in seeds for codec in outer]
    if workers <= 1:
        losses = [_train_job(job) for job in jobs]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            losses = list(pool.map(_train_job, jobs))
    curves: dict[int, dict[str, list[float]]] = {seed: {} for seed in seeds}
    for (codec, _, seed, *_), curve in zip(jobs, losses):
        curves[seed][codec] = curve
    return curves


def reuse_curves(by_seed: dict[int, dict[str, list[float]]], previous: Path, systems: list[str]) -> dict[str, dict]:
    """Fill in `systems` (not trained this run: a sweep of topk alone) from the `previous` result of the same seeds
    and rounds; their outer settings there, by system. Exits with a clear error when that result does not fit."""
    if not systems:
        return {}
    old = json.loads(previous.read_text()) if previous.exists() else {}
    curves = old.get("eval_loss_by_seed", {})
    rounds = len(next(iter(next(iter(by_seed.values())).values())))
    for seed, runs in by_seed.items():
        for system in systems:
            curve = curves.get(str(seed), {}).get(system)
            if curve is None or len(curve) != rounds:
                raise SystemExit(
                    f"error: {previous} has no {rounds}-round curve of {system} for seed {seed}: run it too (--systems)"
                )
            runs[system] = curve
    return {system: old["outer"][system] for system in systems}


def main(argv: list[str] | None = None) -> int:
    """Train every system over every seed, print and write the curves and how far topk trails the better fp32."""
    parser = benchmark_parser(__doc__, quick="tiny model, 40 rounds", smoke="tiny model, 3 rounds (used by the tests)")
    parser.add_argument("--rounds", type=int, help="outer rounds (default 24; --quick 40, --smoke 3)")
    parser.add_argument("--seeds", type=int, nargs="+", help="model-init and batch-order seeds (default 0 1 2)")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time, one thread each (default 2)")
    parser.add_argument(
        "--systems", nargs="+", choices=list(OUTER), default=list(OUTER), help="systems to train (default all)"
    )
    parser.add_argument("--topk-outer-lr", type=float, help="topk's outer lr (a sweep; default SPARSE_DEFAULTS)")
    parser.add_argument("--topk-outer-momentum", type=float, help="topk's outer Nesterov momentum (a sweep)")
    parser.add_argument("--error-feedback-decay", type=float, help="topk's error-feedback decay (a sweep)")
    args = parser.parse_args(argv)
    outer = {system: OUTER[system] for system in args.systems}
    if "topk" in outer:
        lr, momentum = outer["topk"]
        outer["topk"] = (
            lr if args.topk_outer_lr is None else args.topk_outer_lr,
            momentum if args.topk_outer_momentum is None else args.topk_outer_momentum,
        )
    decay = SPARSE_DEFAULTS["network.error_feedback_decay"]
    decay = decay if args.error_feedback_decay is None else args.error_feedback_decay
    tiny = args.quick or args.smoke
    rounds = args.rounds or (3 if args.smoke else 40 if args.quick else 24)
    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2])
    torch.set_num_threads(1)
    started = time.monotonic()
    by_seed = train_all(rounds, seeds, tiny, args.workers, outer, decay)
    name = "sparse_horizon-smoke" if args.smoke else "sparse_horizon"
    reused = reuse_curves(by_seed, args.out / f"{name}.json", [system for system in OUTER if system not in outer])
    settings = {**{system: (old["lr"], old["momentum"]) for system, old in reused.items()}, **outer}
    curves = {
        system: [statistics.fmean(c[system][r] for c in by_seed.values()) for r in range(rounds)] for system in OUTER
    }
    finals = {system: [c[system][-1] for c in by_seed.values()] for system in OUTER}
    reference = min(("fp32", "fp32_sgd"), key=lambda system: statistics.fmean(finals[system]))
    behind = rounds_behind(curves["topk"], curves[reference])
    ratios = {system: [c["topk"][-1] / c[system][-1] for c in by_seed.values()] for system in ("fp32", "fp32_sgd")}
    result = {
        "islands": ISLANDS,
        "H": H,
        "topk_density": DENSITY,
        "outer": {system: {"lr": lr, "momentum": momentum} for system, (lr, momentum) in settings.items()},
        "error_feedback_decay": decay,
        "rounds": rounds,
        "seeds": seeds,
        "model": "tiny" if tiny else "default",
        "eval_loss_by_round": curves,
        "eval_loss_by_seed": {str(seed): c for seed, c in by_seed.items()},
        "final_eval_loss": {system: statistics.fmean(values) for system, values in finals.items()},
        "final_eval_spread": {system: max(values) - min(values) for system, values in finals.items()},
        "fp32_reference": reference,
        "topk_over_fp32": statistics.fmean(ratios[reference]),
        "topk_over_fp32_by_seed": ratios[reference],
        "topk_over_each_fp32": {system: statistics.fmean(values) for system, values in ratios.items()},
        "topk_rounds_behind": behind,
        "wall_s": time.monotonic() - started,
        **provenance("sparse_horizon.py", argv),
        **({"reused_from_previous_run": sorted(reused)} if reused else {}),
    }
    path = write_result(args.out, name, result)
    plot(curves, settings, args.out / f"{name}.png")
    print(
        f"topk / {reference} after {rounds} rounds, seeds {seeds}: {result['topk_over_fp32']:.3f} {ratios[reference]}"
    )
    print(f"topk / each fp32: {result['topk_over_each_fp32']}; rounds behind {reference}: {behind}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

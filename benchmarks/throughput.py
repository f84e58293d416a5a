"""Tokens/s of one island against a plain PyTorch training loop, and what one outer step costs by model size.

Island: a solo p2p-diloco island (the real Island loop: H = 50 inner steps, then pseudo-gradient, outer Nesterov
step and weights loaded back, no network), timed over its rounds without evaluation. Plain loop: the same model,
batches, AdamW and schedule in a bare `for` loop. Both run in this process, alternating, one thread each, and the
ratio of their median tokens/s is reported. Then the outer step alone (weights out, pseudo-gradient, Nesterov step,
weights in) for models of about 1M, 10M and 50M parameters. On a CUDA machine the same is run for the 150M-shaped
Llama in bf16, with MFU and peak memory.

    python benchmarks/throughput.py            # 3 alternating repeats, 10 rounds of H = 50 each
    python benchmarks/throughput.py --quick    # 2 repeats, 4 rounds
    python benchmarks/throughput.py --smoke    # 1 repeat, 1 round, small models (used by the tests)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from lib.common import benchmark_parser, provenance, write_result

from p2p_diloco.config import PeerConfig, load_config
from p2p_diloco.diloco.inner import make_inner_optimizer, run_inner_steps
from p2p_diloco.diloco.outer import pseudo_gradient
from p2p_diloco.island.island import Island
from p2p_diloco.island.outer_state import OuterState
from p2p_diloco.island.trainer import LocalTrainer
from p2p_diloco.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
TINY_LLAMA = REPO / "peers" / "tiny-llama.toml"
SIZES = {"1M": (128, 4), "10M": (384, 6), "50M": (768, 7)}
"""Built-in GPT shapes (d_model, n_layers) of about 1M, 10M and 50M parameters."""


CPU_RUN = {"train.batch_size": 16, "train.warmup_steps": 10, "train.threads": 1}


def island_config(toml: Path, rounds: int, out: Path, overrides: dict) -> PeerConfig:
    """A solo island of `toml` at H = 50 for `rounds` outer steps, metrics to `out`."""
    base = {"network.solo": True, "train.inner_steps": 50, "train.outer_steps": rounds, "metrics": str(out)}
    return load_config(toml, base | overrides)


def island_tokens_per_s(toml: Path, rounds: int, out: Path, overrides: dict) -> float:
    """Median tokens/s of a solo island's rounds (inner steps and outer step, evaluation left out)."""
    out.unlink(missing_ok=True)
    Island(island_config(toml, rounds, out, overrides)).run()
    records = read_metrics(out)
    tokens = [r["tokens"] - previous for r, previous in zip(records, [0] + [r["tokens"] for r in records])]
    return statistics.median(t / (r["round_s"] - r["eval_s"]) for t, r in zip(tokens, records))


def plain_tokens_per_s(toml: Path, rounds: int, overrides: dict) -> float:
    """Tokens/s of a bare loop over the same model, batches and optimizer, same number of steps."""
    config = island_config(toml, rounds, Path("/dev/null"), overrides)
    torch.set_num_threads(config.train.threads)  # as the island does
    trainer = LocalTrainer(config)  # the same model, data and device, without the island around it
    trainer.open_stream("solo")
    model = trainer.model
    optimizer, scheduler = make_inner_optimizer(model, config.train.lr, config.train.weight_decay, 10)
    rates = []
    for _ in range(rounds):  # in chunks of H steps, the island's rounds
        rates.append(_timed_chunk(trainer, optimizer, scheduler, config))
    return statistics.median(rates)


def _timed_chunk(trainer: LocalTrainer, optimizer, scheduler, config: PeerConfig) -> float:
    """Tokens/s of H plain inner steps."""
    model = trainer.model
    start = time.monotonic()
    result = run_inner_steps(
        model,
        optimizer,
        scheduler,
        trainer.stream.next_batch,
        config.train.inner_steps,
        grad_clip=config.train.grad_clip,
        accumulate=config.train.grad_accum,
        autocast=trainer.precision.autocast,
        scaler=trainer.precision.scaler,
        device=trainer.device,
    )
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return result.tokens / (time.monotonic() - start)


def outer_step_ms(label: str, repeats: int) -> dict:
    """Median milliseconds of one outer step (weights out, pseudo-gradient, Nesterov, weights in) at one size."""
    d_model, layers = SIZES[label]
    overrides = {"model.d_model": d_model, "model.n_layers": layers, "model.n_heads": 8, "model.seq_len": 64}
    config = load_config(None, overrides | {"train.threads": 1})
    trainer = LocalTrainer(config)
    state = OuterState(trainer.weights(), lr=0.7, momentum=0.9, momentum_every=1, fingerprint="f", run_id="r")
    fragment = _whole(trainer)
    times = []
    for _ in range(repeats):
        start = time.monotonic()
        delta = pseudo_gradient(state.anchor, trainer.weights())
        state.step(delta, fragment)
        trainer.load_all(state.anchor)
        times.append(1000 * (time.monotonic() - start))
    return {"size": label, "params": trainer.numel, "outer_step_ms": statistics.median(times)}


def _whole(trainer: LocalTrainer):
    from p2p_diloco.diloco.fragments import fragment_layout

    return fragment_layout(trainer.model, 1)[0]


def main(argv: list[str] | None = None) -> int:
    """Measure, print and write throughput.json."""
    parser = benchmark_parser(__doc__, quick="2 repeats of 4 rounds", smoke="1 repeat of 1 round, 1M/10M only")
    args = parser.parse_args(argv)
    repeats, rounds = (1, 1) if args.smoke else (2, 4) if args.quick else (3, 10)
    runs = args.out / "throughput-runs"
    runs.mkdir(parents=True, exist_ok=True)
    island, plain = [], []
    for repeat in range(repeats):  # alternate, so that machine noise hits both alike
        plain.append(plain_tokens_per_s(TINY_LLAMA, rounds, CPU_RUN))
        island.append(island_tokens_per_s(TINY_LLAMA, rounds, runs / f"island-{repeat}.jsonl", CPU_RUN))
        print(f"repeat {repeat + 1}: plain loop {plain[-1]:,.0f} tokens/s, island {island[-1]:,.0f} tokens/s")
    ratio = statistics.median(island) / statistics.median(plain)
    print(f"island / plain loop: {ratio:.3f} (tiny Llama, CPU, H = 50, outer step included)")
    sizes = ["1M", "10M"] if args.smoke else list(SIZES)
    rows = [outer_step_ms(size, 3 if args.smoke else 5) for size in sizes]
    for row in rows:
        print(f"outer step, {row['params'] / 1e6:.1f}M parameters: {row['outer_step_ms']:.1f} ms")
    result = {
        "ratio_vs_plain_loop": ratio,
        "island_tokens_per_s": island,
        "plain_tokens_per_s": plain,
        "rows": rows,
        "gpu": gpu_figures(runs) if torch.cuda.is_available() else None,
        **provenance("throughput.py", argv),
    }
    path = write_result(args.out, "throughput-smoke" if args.smoke else "throughput", result)
    print(f"wrote {path}")
    return 0


def gpu_figures(runs: Path) -> dict:
    """The 150M-shaped Llama in bf16 on this GPU: island and plain-loop tokens/s, MFU, peak memory."""
    toml = REPO / "peers" / "llama-150m.toml"
    overrides = {"train.device": "cuda", "train.precision": "bf16", "train.grad_accum": 1, "train.warmup_steps": 10}
    overrides |= {"data.eval_batches": 1}
    config = load_config(toml, overrides)
    params = LocalTrainer(config).numel
    torch.cuda.reset_peak_memory_stats()
    plain = plain_tokens_per_s(toml, 1, overrides)
    island = island_tokens_per_s(toml, 1, runs / "island-gpu.jsonl", overrides)
    peak_flops = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(), None)
    flops_per_token = 6 * params  # forward and backward, attention left out: the usual lower bound
    return {
        "gpu": torch.cuda.get_device_name(),
        "params": params,
        "island_tokens_per_s": island,
        "plain_tokens_per_s": plain,
        "island_mfu": island * flops_per_token / peak_flops if peak_flops else None,
        "plain_mfu": plain * flops_per_token / peak_flops if peak_flops else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
    }


PEAK_BF16_FLOPS = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}
"""Dense bf16 peak of the GPUs these runs are likely to see, for MFU."""


if __name__ == "__main__":
    raise SystemExit(main())

"""`peer --nproc-per-node N`: start an island's ranks through torch's elastic launcher, exactly as torchrun would.

The launcher re-runs this same command line in every rank (`python -m p2p_diloco peer ...`); a rank sees the
launcher's environment (`p2p_diloco.island.ranks.launched_as_rank`) and joins the island's process group instead
of launching again. When any rank dies the launcher ends the others (the agent's shutdown), restarts the island
if `--max-restarts` allows, and otherwise names the rank that failed first.
"""

from __future__ import annotations

import signal
import sys

from p2p_diloco.config import IslandConfig, PeerConfig

MONITOR_INTERVAL_S = 0.5
"""How often the launcher checks its ranks: a dead rank ends the island within about this."""
SHUTDOWN_TIMEOUT_S = 15
"""How long ranks get to stop cleanly (rank 0 finishes its round and checkpoints) before they are killed."""


def wants_ranks(island: IslandConfig) -> bool:
    """True when the island is more than one process on this node, or spans nodes."""
    return island.nproc_per_node > 1 or island.nnodes.split(":")[-1] != "1"


def torchrun_arguments(config: PeerConfig, argv: list[str]) -> list[str]:
    """torchrun's command line for this island: its ranks run `python -m p2p_diloco` with `argv`."""
    island = config.island
    arguments = [
        f"--nproc-per-node={island.nproc_per_node}",
        f"--nnodes={island.nnodes}",
        f"--max-restarts={island.max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL_S}",
        f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
    ]
    if island.rdzv_endpoint:
        rdzv_id = island.rdzv_id or config.network.run_id
        arguments += ["--rdzv-backend=c10d", f"--rdzv-endpoint={island.rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    else:
        arguments.append("--standalone")
    return [*arguments, "-m", "p2p_diloco", *argv]


def check_devices(config: PeerConfig) -> None:
    """Refuse, before any rank starts, an island that asks for more GPUs than this node has (one per rank)."""
    import torch

    from p2p_diloco.errors import ConfigError
    from p2p_diloco.train.devices import resolve_device

    device = resolve_device(config.train.device)  # the one-line error for a device this machine lacks
    ranks = config.island.nproc_per_node
    if device.type == "cuda" and ranks > torch.cuda.device_count():
        raise ConfigError(
            f"--nproc-per-node {ranks} needs a GPU per rank; this node shows {torch.cuda.device_count()}: "
            "lower --nproc-per-node or check CUDA_VISIBLE_DEVICES"
        )


def describe_failure(rank: int, failure: object) -> str:
    """One line on how a rank ended: its exit code or the signal that killed it."""
    code = getattr(failure, "exitcode", None)
    how = f"killed by {signal.Signals(-code).name}" if isinstance(code, int) and code < 0 else f"exit code {code}"
    pid = getattr(failure, "pid", "?")
    return f"rank {rank} (local rank {getattr(failure, 'local_rank', '?')}, pid {pid}) failed: {how}"


def first_own_failure(failed: object) -> tuple[int, object]:
    """The rank that failed first on its own, passing over ranks that only exited because the island broke.

    The agent stamps failures in whole seconds, so a SIGKILLed rank and the rank 0 that noticed it often tie; a
    rank ended by SIGTERM in the same second was most likely stopped by the agent because another one failed.
    """
    from p2p_diloco.island.ranks import LOST_RANKS_EXIT

    failures = getattr(failed, "failures", {})
    own = {rank: f for rank, f in failures.items() if getattr(f, "exitcode", None) != LOST_RANKS_EXIT}
    if not own:
        return failed.get_first_failure()
    stopped = -signal.SIGTERM

    def order(item: tuple[int, object]) -> tuple:
        rank, failure = item
        return (failure.timestamp, failure.exitcode == stopped, failure.exitcode >= 0, rank)

    signalled_first = sorted(own.items(), key=order)
    return signalled_first[0]


def launch_island(config: PeerConfig, argv: list[str]) -> int:
    """Run the island's ranks until they finish; the exit code, with the first failed rank named on stderr."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    island = config.island
    check_devices(config)
    print(
        f"p2p-diloco peer: starting an island of {island.nproc_per_node} ranks per node on {island.nnodes} node(s) "
        f"({island.parallel})",
        file=sys.stderr,
    )
    try:
        run(parse_args(torchrun_arguments(config, argv)))
    except ChildFailedError as failed:
        rank, failure = first_own_failure(failed)
        print(
            f"p2p-diloco peer: error: {describe_failure(rank, failure)}; the island's other ranks were stopped"
            + (f" after {island.max_restarts} restarts" if island.max_restarts else ""),
            file=sys.stderr,
        )
        return 1
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    return 0

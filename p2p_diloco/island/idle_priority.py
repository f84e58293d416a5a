"""A standby warms up at idle CPU priority, so the island it waits for keeps its CPU.

A standby (`--standby true`) imports torch, builds its model and loads its data while the island it would replace
trains beside it, on the same cores: measured in benchmarks/chaos.py, a standby per island under each island's CPU
quota cost its island 20% of a clean run's tokens. Under Linux's SCHED_IDLE the warm-up runs only on CPU time the
island leaves idle (its waits for partners, data and disk). Back to normal priority before the standby waits for
the folder, so that the island it becomes runs as any other.

Only where the process may switch back: a thread can leave SCHED_IDLE with CAP_SYS_NICE (root) or a high enough
RLIMIT_NICE; elsewhere the warm-up keeps normal priority rather than leave the new island at idle priority for good.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def can_leave_idle_priority() -> bool:
    """Whether this process could switch its threads from SCHED_IDLE back to SCHED_OTHER at nice 0."""
    if not hasattr(os, "SCHED_IDLE"):
        return False  # not Linux
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


def _threads() -> list[int]:
    """The native ids of this process's threads."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_policy(tids: list[int], policy: int) -> None:
    """Set the scheduling policy of these threads (native ids; 0: the calling one), skipping those gone."""
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile


@contextmanager
def idle_priority(what: str) -> Iterator[bool]:
    """Run the body at SCHED_IDLE (threads it starts inherit it), then every thread at normal priority again.

    Yields whether the priority was lowered (False where the process could not switch back)."""
    if not can_leave_idle_priority():
        logger.info(f"{what} at normal CPU priority: this process could not leave idle priority afterwards")
        yield False
        return
    set_policy([0], os.SCHED_IDLE)
    logger.info(f"{what} at idle CPU priority (SCHED_IDLE): the island beside it keeps its CPU")
    try:
        yield True
    finally:
        set_policy(_threads(), os.SCHED_OTHER)

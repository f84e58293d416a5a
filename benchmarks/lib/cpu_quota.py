"""Separate machines' CPUs on one machine: each island in a cgroup with a fixed CPU quota.

Islands sharing two cores without quotas trade CPU: a killed or frozen island's share speeds the others up, and a
restarting island's imports (seconds of a core) slow them down, so a goodput measured that way mixes the fault's
cost with the scheduler's reshuffling. With a quota per island each one computes as it would on a machine of its
own, and what a fault costs is what the swarm loses. cgroup v1 (`cpu.cfs_quota_us`) or v2 (`cpu.max`), as root;
elsewhere `CpuQuotas.mode` says why islands run unconstrained. A process is moved into its group by a `sh`
prefix before it execs, so every child it starts (p2pd, the averager) is in the group too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000
"""The quota's period. A quota is spent within its period by anything in the group, and a group that has spent it
runs nothing until the next one: a standby warming up at SCHED_IDLE in the time its island waits for partners
spends quota the island then lacks, and a throttled island answers no message until the period ends. A machine of
its own has neither effect; the kernel's default 100 ms period made both up to 100 ms long, a 10 ms one bounds
them to 10 ms (the kernel accepts 1 ms and up). Measured in chaos.py, the change moved no goodput beyond its
run-to-run spread (decoupled 0.78 against 0.76), and standbys still cost their islands' clean run about a quarter
of its tokens."""


def _writable_v1() -> bool:
    return (V1 / "cgroup.procs").exists() and os.access(V1, os.W_OK)


def _writable_v2() -> bool:
    controllers = V2 / "cgroup.controllers"
    return controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2, os.W_OK)


class CpuQuotas:
    """One cgroup per island with `cpus` cores of quota (None or 0: no quota) per `period_us`; `close()` removes
    them."""

    def __init__(self, name: str, cpus: float | None, period_us: int = PERIOD_US):
        self.name, self.cpus, self.period_us = name, cpus, period_us
        self.groups: dict[int, Path] = {}
        if not cpus:
            self.mode = "none (no quota asked for)"
        elif os.geteuid() != 0:
            self.mode = "none (cgroups need root)"
        elif _writable_v1():
            self.mode = "cgroup v1 cpu.cfs_quota_us"
        elif _writable_v2():
            self.mode = "cgroup v2 cpu.max"
        else:
            self.mode = "none (no writable cgroup cpu controller)"

    @property
    def active(self) -> bool:
        """Whether islands run under a quota."""
        return self.mode.startswith("cgroup")

    def prefix(self, index: int) -> list[str]:
        """The command prefix that runs island `index` inside its group (empty without quotas)."""
        if not self.active:
            return []
        group = self.groups.get(index) or self._make(index)
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs")]

    def _make(self, index: int) -> Path:
        quota = max(1000, int(self.cpus * self.period_us))  # the kernel's smallest quota is 1 ms
        if self.mode.startswith("cgroup v1"):
            group = V1 / f"{self.name}-{os.getpid()}-{index}"
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(self.period_us))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (V2 / "cgroup.subtree_control").write_text("+cpu")
            group = V2 / f"{self.name}-{os.getpid()}-{index}"
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{quota} {self.period_us}")
        self.groups[index] = group
        return group

    def close(self) -> None:
        """Remove the groups (their processes have exited); a group still busy is left and named."""
        for group in self.groups.values():
            deadline = time.monotonic() + 10
            while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.1)  # killed children leave their group as the kernel reaps them: no event to await
            try:
                group.rmdir()
            except OSError as error:
                print(f"could not remove cgroup {group}: {error}", flush=True)
        self.groups.clear()

"""Child processes that die with their parent: hivemind's DHT and averager processes, and their p2pd daemon.

hivemind forks a DHT process that starts p2pd, and an averager process; if the Python parent is SIGKILLed
they all stay alive as orphans. A parent-death signal set in each child removes them within seconds.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
from collections.abc import Callable
from typing import Any

import hivemind

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _exec_with_parent_death(original: Callable[..., Any]) -> Callable[..., Any]:
    async def create_subprocess_exec(*args: Any, **kwargs: Any) -> Any:
        user_preexec = kwargs.pop("preexec_fn", None)

        def preexec() -> None:
            die_with_parent()
            if user_preexec is not None:
                user_preexec()

        return await original(*args, preexec_fn=preexec, **kwargs)

    return create_subprocess_exec


class OrphanFreeDHT(hivemind.DHT):
    """hivemind.DHT whose process, and the p2pd daemon it starts, die when the owning process dies."""

    def run(self) -> None:
        """Serve the DHT after arranging to die with the parent process."""
        die_with_parent()
        # p2pd is started from inside this process via asyncio; make it die with us too.
        asyncio.subprocess.create_subprocess_exec = _exec_with_parent_death(asyncio.subprocess.create_subprocess_exec)
        super().run()


def kill_process_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to a process and all its descendants (used by launchers and tests)."""
    import psutil

    try:
        parent = psutil.Process(pid)
        family = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def pid_alive(pid: int) -> bool:
    """True while a process exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

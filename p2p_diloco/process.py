"""Child processes that die with their parent, and killing a whole process tree (no hivemind here).

hivemind forks a DHT process that starts p2pd, and an averager process; if the Python parent is SIGKILLed they
all stay alive as orphans. A parent-death signal set in each child removes them within seconds.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent thread exits (Linux only; no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def keep_freed_memory(retain_bytes: int = 1 << 30) -> None:
    """Let glibc reuse freed buffers of up to 32 MB instead of returning them to the kernel (Linux, glibc only).

    An averaging round allocates and frees hundreds of part-sized buffers; with glibc's defaults many come back as
    fresh pages, and zeroing them in page faults cost more than the copies themselves (a third of the averager's
    CPU in benchmarks/exchange.py's profile)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, retain_bytes)
    except (OSError, AttributeError):
        return


def ignore_group_stop_signals() -> None:
    """In a helper process (DHT, averager): leave SIGINT and SIGTERM to the process that owns it.

    Ctrl-C and service managers signal a whole process group; the owner then stops at a safe point and shuts its
    helpers down through their pipes. A helper that died on the signal first would leave the owner's round hanging.
    The helper still dies with its owner (`die_with_parent`).
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


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

"""One island per checkpoint folder: a lock that the kernel releases when the island's process ends, however it ends.

Two islands writing one folder overwrite each other's checkpoints (the same file name per outer step), and a restart
then resumes one island from the other's shard, data position and momentum. A second peer on a folder in use is
refused with a one-line error. A standby (`--standby true`) waits for the folder instead, with its interpreter,
imports, model and data ready, and takes over the moment the island before it stops or dies (SIGKILL and power loss
included: an flock dies with its holder's file descriptors).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
from pathlib import Path

from p2p_diloco.errors import UserError

logger = logging.getLogger(__name__)

LOCK_NAME = ".island.lock"
"""The lock file inside the checkpoint folder; it holds the owner's pid and host, for the messages."""


class FolderInUseError(UserError):
    """Another island holds the checkpoint folder."""


class CheckpointFolderLock:
    """The exclusive claim of one island on its checkpoint folder, held until released or the process ends."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        # A forked child (the DHT and averager processes) would share the lock and keep it after this island died,
        # until the last child exits: children drop their copy (closing it, never unlocking: that would free the
        # parent's lock too). Exec'd programs (p2pd, torch ranks) never get it: os.open's descriptors close on exec.
        os.register_at_fork(after_in_child=self._forget_in_child)

    def try_acquire(self) -> bool:
        """Take the folder if no other process holds it; True if this process now does."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._mark_owner()
        return True

    def acquire_or_refuse(self) -> None:
        """Take the folder, or raise FolderInUseError naming the process that holds it and what to do."""
        if not self.try_acquire():
            raise FolderInUseError(
                f"checkpoint folder {self.directory} is in use by another island ({self.owner()}): stop it, pass "
                "another --checkpoint-dir, or pass --standby true to take over when it stops"
            )

    def wait(self) -> float:
        """Block until the folder is free and take it (a stop signal interrupts the wait); the seconds waited."""
        started = time.monotonic()
        if self.try_acquire():
            return 0.0
        logger.info(f"standby: waiting to take over checkpoint folder {self.directory} from {self.owner()}")
        taken = threading.Event()

        def take() -> None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # blocks in C: a thread, so that a stop signal reaches the main one
            taken.set()

        threading.Thread(target=take, name="standby-lock", daemon=True).start()
        taken.wait()  # interruptible: GracefulStop raises Stopped here at SIGINT or SIGTERM
        self._mark_owner()
        waited = time.monotonic() - started
        logger.info(f"standby: took over checkpoint folder {self.directory} after {waited:.1f}s")
        return waited

    def release(self) -> None:
        """Give the folder up (the process's end does the same)."""
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor of the open file frees its flock
            self._fd = -1

    def owner(self) -> str:
        """Who holds the folder, as its lock file says (for messages)."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        return text or "a process that wrote no pid"

    def _forget_in_child(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _mark_owner(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

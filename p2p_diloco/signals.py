"""Clean stops: the first Ctrl-C or SIGTERM asks for a stop at the next safe point, a second one stops at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The shell's conventions: 128 + the signal number."""


class Stopped(BaseException):
    """Raised where a stop signal arrived outside a deferring section (nothing to save there)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)


class GracefulStop:
    """Turns SIGINT and SIGTERM into a request that long-running work checks at its safe points.

    Inside `deferred()` the first signal only sets `requested` (the work finishes or discards its round, writes
    its checkpoint and shuts its daemons down); outside it, or at the second signal, the process stops at once:
    `Stopped` is raised, or on a second signal the process exits immediately (its hivemind children follow
    through their parent-death signal).
    """

    def __init__(self, what: str = "p2p-diloco", *, hard_after_s: float | None = None):
        self.what = what
        self.hard_after_s = hard_after_s
        """With a value, a stop not finished this many seconds after the first signal exits at once."""
        self.signum: int | None = None
        self._deferring = False
        self._event = threading.Event()

    def install(self) -> GracefulStop:
        """Handle SIGINT and SIGTERM in this (main) thread from now on."""
        for signum in EXIT_CODES:
            signal.signal(signum, self._handle)
        self._watch_for_a_second_signal()
        return self

    def _watch_for_a_second_signal(self) -> None:
        """A thread that exits at the second stop signal whatever the main thread is doing.

        Python runs signal handlers in the main thread only, between bytecodes: a main thread inside one long C call
        (a torch kernel, a blocking read, a sleep the signal landed beside) would run the second signal's handler
        only when that call returns. The C-level handler writes each signal's number to the wakeup fd at once, and
        this process's watcher thread reads it there for the latest installed stop.
        """
        watcher = _WakeupWatcher.for_this_process()
        if watcher is not None:
            watcher.watch(self)

    def _exit_now(self, signum: int) -> None:
        print(f"{self.what}: {signal.Signals(signum).name} again: stopping now", file=sys.stderr, flush=True)
        os._exit(EXIT_CODES.get(signum, 128 + signum))

    @property
    def requested(self) -> bool:
        """True once a stop was asked for."""
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """130 after SIGINT, 143 after SIGTERM."""
        return EXIT_CODES.get(self.signum, 1) if self.signum is not None else 0

    @property
    def name(self) -> str:
        """SIGINT or SIGTERM."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def report_checkpoint_kept(self) -> None:
        """Say on stderr, after a stop that was asked for, that the island ended at a safe point."""
        if self.requested:
            print(f"{self.what}: stopped by {self.name}; the last checkpoint is kept", file=sys.stderr)

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, waking as soon as a stop is requested; True if one was."""
        return self._event.wait(timeout)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A section where the first signal only requests a stop."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            self._exit_now(signum)
        self.signum = signum
        self._event.set()
        if self.hard_after_s is not None:
            timer = threading.Timer(self.hard_after_s, os._exit, (EXIT_CODES.get(signum, 128 + signum),))
            timer.daemon = True
            timer.start()
        if not self._deferring:
            raise Stopped(signum)
        print(
            f"{self.what}: {self.name}: stopping at the next safe point (again to stop at once)",
            file=sys.stderr,
            flush=True,
        )


class _WakeupWatcher:
    """The process's one wakeup-fd pipe and the thread that reads it; never closed, so its fds stay its own."""

    _current: _WakeupWatcher | None = None

    def __init__(self, reader: int, writer: int):
        self.reader, self.writer = reader, writer
        self.stop: GracefulStop | None = None
        self.seen = 0

    @classmethod
    def for_this_process(cls) -> _WakeupWatcher | None:
        """The watcher (started on first use), with the wakeup fd pointed at it; None outside the main thread."""
        if cls._current is None:
            reader, writer = os.pipe()
            os.set_blocking(writer, False)
            try:
                signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
            except ValueError:  # not the main thread: the handlers could not be installed either
                os.close(reader)
                os.close(writer)
                return None
            cls._current = cls(reader, writer)
            # A forked child (hivemind's DHT and averager processes) inherits the wakeup fd: systemd's SIGTERM to
            # the whole group would then count once per process here. The child forgets it.
            os.register_at_fork(after_in_child=cls._forget_in_child)
            threading.Thread(target=cls._current._read, name="second-signal", daemon=True).start()
        else:
            try:  # asyncio's add_signal_handler may have pointed the wakeup fd elsewhere since
                signal.set_wakeup_fd(cls._current.writer, warn_on_full_buffer=False)
            except ValueError:
                return None
        return cls._current

    def watch(self, stop: GracefulStop) -> None:
        """Count stop signals for `stop` from now on."""
        self.stop, self.seen = stop, 0

    def _read(self) -> None:
        while data := os.read(self.reader, 64):
            for signum in data:
                if signum in EXIT_CODES and self.stop is not None:
                    self.seen += 1
                    if self.seen >= 2:
                        self.stop._exit_now(signum)

    @classmethod
    def _forget_in_child(cls) -> None:
        watcher, cls._current = cls._current, None
        if watcher is None:
            return
        try:
            previous = signal.set_wakeup_fd(-1)
            if previous != watcher.writer:  # not ours any more: leave it as it was
                signal.set_wakeup_fd(previous)
        except ValueError:
            pass
        os.close(watcher.reader)
        os.close(watcher.writer)

"""What an island tells its averager before a round: what it matches on, and the group size that starts at once."""

from __future__ import annotations

import hashlib

from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.timeouts import AVERAGER_COMMAND_S


class RoundSettingsMixin:
    """The per-round settings half of `PseudoGradientAverager` (the averager runs in its own process: each value
    travels over its command pipe)."""

    def set_schema_tag(self, tag: int | None) -> None:
        """Match only with islands exchanging the same thing (e.g. the same fragment) from now on."""
        future = MPFuture()
        self._outer_pipe.send(("_set_schema_tag", [], dict(tag=tag, future=future)))
        future.result(timeout=AVERAGER_COMMAND_S)

    async def _set_schema_tag(self, tag: int | None, future: MPFuture) -> None:
        suffix = b"" if tag is None else f"fragment-{tag}".encode()
        self._matchmaking.schema_hash = (
            hashlib.sha256(self.schema_hash + suffix).digest() if suffix else self.schema_hash
        )
        future.set_result(True)

    def set_group_target(self, size: int) -> None:
        """Start a group this island leads as soon as it has `size` members (p2p_diloco.diloco.expected_group)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_group_target", [], dict(size=size, future=future)))
        future.result(timeout=AVERAGER_COMMAND_S)

    async def _set_group_target(self, size: int, future: MPFuture) -> None:
        # hivemind's Matchmaking reads target_group_size on every join request (a full group starts at once and
        # turns later joiners away); it has no setter, so the attribute is set directly.
        self._matchmaking.target_group_size = max(1, int(size))
        future.set_result(True)

"""The averager's side of a per-round group target (`p2p_diloco.diloco.expected_group`)."""

from __future__ import annotations

from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.timeouts import AVERAGER_COMMAND_S


class GroupTargetMixin:
    """Lets the island set hivemind's matchmaking target size before each round (the averager runs in its own
    process: the value travels over its command pipe)."""

    def set_group_target(self, size: int) -> None:
        """Start a group this island leads as soon as it has `size` members (the cap is network.target_group_size)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_group_target", [], dict(size=size, future=future)))
        future.result(timeout=AVERAGER_COMMAND_S)

    async def _set_group_target(self, size: int, future: MPFuture) -> None:
        # hivemind's Matchmaking reads target_group_size on every join request (a full group starts at once and
        # turns later joiners away); it has no setter, so the attribute is set directly.
        self._matchmaking.target_group_size = max(1, int(size))
        future.set_result(True)

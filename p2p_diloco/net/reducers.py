"""The reducers of p2p-diloco's all-reduce: each averages one part of every member's vector.

`StrictPartReducer` is the plain weighted mean, accumulated as parts arrive; once a sender fails before it has sent
every part, its results turn to NaN, so every survivor discards the round. `RobustPartReducer` keeps every
member's part until all are in, drops non-finite ones (naming their sender) and applies a robust rule
(`p2p_diloco.diloco.robust`). `SparsePartReducer` (codec topk) divides each value by the weight of the senders
that sent it (`p2p_diloco.diloco.merge.contributor_mean`). All cap each sender's declared weight at what the
group's metadata allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.utils import get_logger

from p2p_diloco.diloco.merge import contributor_mean, rescale_to_contributors
from p2p_diloco.diloco.robust import aggregate

logger = get_logger(__name__)

Dropped = Callable[[int, str], None]
"""Called with a sender's index and why its contribution was dropped."""


class StrictPartReducer(TensorPartReducer):
    """A reducer whose results turn to NaN once a sender fails before it has sent every part."""

    poisoned = False

    def __init__(self, part_shapes: Sequence[torch.Size], weight_caps: Sequence[float], on_dropped: Dropped | None):
        self.weight_caps, self.on_dropped = list(weight_caps), on_dropped
        super().__init__(part_shapes, len(self.weight_caps))

    def _capped(self, sender_index: int, weight: float) -> float:
        cap = self.weight_caps[sender_index]
        if weight > cap:
            # A cap of 0 (banned, or too stale for the group) was named when it was set.
            if self.current_part_index == 0 and self.on_dropped is not None and cap > 0:
                self.on_dropped(sender_index, f"a declared weight of {weight:.3g}, above the group's bound {cap:.3g}")
            return cap
        return max(0.0, weight)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        """Add a sender's part (weight capped), wait until every sender's part is in, then return the result."""
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # earlier parts are still being reduced
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            self._add(sender_index, tensor_part, self._capped(sender_index, weight))
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def _add(self, sender_index: int, tensor_part: torch.Tensor, weight: float) -> None:
        self.accumulator.add_(tensor_part, alpha=weight)
        self.denominator += weight

    def _result(self) -> torch.Tensor:
        return self.accumulator.div_(self.denominator)

    def on_sender_failed(self, sender_index: int) -> None:
        """Mark the rest of this reduction as invalid unless the sender had already sent all its parts."""
        if self.num_parts_received[sender_index] < self.num_parts and not self.finished.is_set():
            self.poisoned = True
        super().on_sender_failed(sender_index)

    def check_current_part_finished(self) -> None:
        """Finish the current part: the reduction, or NaN if the round is poisoned (or nothing has weight)."""
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            result = None
            if not self.poisoned and self.denominator > 0:
                try:
                    result = self._result()
                except ValueError:  # no member sent a finite part
                    result = None
            if result is None:
                result = self.accumulator.fill_(float("nan"))
            self.current_part_future.set_result(result)
            self.reset_accumulators()

    def reset_accumulators(self) -> None:
        """Empty buffers for the next part."""
        self.contributions: list[tuple[int, torch.Tensor, float]] = []
        super().reset_accumulators()


class SparsePartReducer(StrictPartReducer):
    """The weighted mean of top-k contributions over the senders that chose each value, not over all senders.

    The divisor is never below the heaviest sender's weight, so a value that only a discounted (stale) island sent
    keeps that island's discount; a sender of weight 0 (banned, too stale) adds nothing anywhere."""

    def _add(self, sender_index: int, tensor_part: torch.Tensor, weight: float) -> None:
        super()._add(sender_index, tensor_part, weight)
        self.coverage.add_(tensor_part != 0, alpha=weight)  # NaN != 0: poison still reaches the result
        self.heaviest = max(self.heaviest, weight)

    def _result(self) -> torch.Tensor:
        return contributor_mean(self.accumulator, self.coverage, self.heaviest)

    def reset_accumulators(self) -> None:
        """Empty buffers (sums and each value's contributing weight) for the next part."""
        super().reset_accumulators()
        if 0 <= self.current_part_index < self.num_parts and not self.finished.is_set():
            self.coverage, self.heaviest = torch.zeros(self.part_shapes[self.current_part_index]), 0.0


class RobustPartReducer(StrictPartReducer):
    """Keeps every member's part, drops non-finite ones and reduces the rest with a robust rule.

    With `sparse` (codec topk) and CenteredClip, whose result is a (clipped) weighted mean, each value is then scaled
    from all members' weight to the weight of those that sent it, as `SparsePartReducer` does for the plain mean.
    The coordinate-wise median and trimmed mean are left as they are: a value most members left out is an outlier to
    them, and scaling an order statistic would not make it one over the senders."""

    def __init__(self, rule: str, part_shapes, weight_caps, on_dropped, sparse: bool = False):
        self.rule, self.sparse = rule, sparse
        super().__init__(part_shapes, weight_caps, on_dropped)

    def _add(self, sender_index: int, tensor_part: torch.Tensor, weight: float) -> None:
        self.contributions.append((sender_index, tensor_part, weight))
        self.denominator += weight

    def _result(self) -> torch.Tensor:
        senders = [sender for sender, _, _ in self.contributions]
        flagged: dict[int, str] = {}
        value, dropped = aggregate(
            self.rule, [part for _, part, _ in self.contributions], [w for _, _, w in self.contributions], flagged
        )
        if self.sparse and self.rule == "clip":
            kept = [(part, w) for i, (_, part, w) in enumerate(self.contributions) if i not in dropped and w > 0]
            value = rescale_to_contributors(value.view(-1), [part for part, _ in kept], [w for _, w in kept])
        flagged.update({index: "NaN or inf in its pseudo-gradient" for index in dropped})
        if self.on_dropped is not None and (self.current_part_index == 0 or dropped):
            for index, why in flagged.items():
                self.on_dropped(senders[index], why)
        return self.accumulator.copy_(value.view_as(self.accumulator))


def make_reducer(
    rule: str,
    part_shapes: Sequence[torch.Size],
    weight_caps: Sequence[float],
    on_dropped: Dropped | None,
    sparse: bool = False,
) -> StrictPartReducer:
    """The reducer for a robust-merge rule ('none': the strict weighted mean), over each value's senders if `sparse`."""
    if rule == "none":
        return (SparsePartReducer if sparse else StrictPartReducer)(part_shapes, weight_caps, on_dropped)
    return RobustPartReducer(rule, part_shapes, weight_caps, on_dropped, sparse)

"""Which outer state a group of islands should share after a merge.

Reducers return bit-identical averages, so islands that applied the same merges from the same state hold the
same bits: a digest of (anchor, momentum) names their lineage. After a merge, islands off the group's
canonical lineage (they missed a round, or came back from a stall) download it from a member that is on it.
"""

from __future__ import annotations

Lineage = tuple[int, str]
"""(outer step, digest of the outer state) before the merge."""


def canonical_lineage(members: dict[str, Lineage]) -> Lineage:
    """The most advanced lineage, then the most common, then the smallest digest: every member picks the same."""
    counts: dict[Lineage, int] = {}
    for lineage in members.values():
        counts[lineage] = counts.get(lineage, 0) + 1
    return max(counts, key=lambda lineage: (lineage[0], counts[lineage], lineage[1]))


def donors(members: dict[str, Lineage], canonical: Lineage) -> list[str]:
    """Members on the canonical lineage, in a stable order."""
    return sorted(peer for peer, lineage in members.items() if lineage == canonical)

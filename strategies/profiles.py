"""What a node reports in the handshake (its ``query`` reply), as the server keeps it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from experiment.protocol import ProfileReply


@dataclass
class NodeProfile:
    """What a node reported in the handshake."""

    node_id: int
    tier: str
    memory_mb: float
    num_examples: int
    labeled: bool
    variant: str | None
    reason: str
    key: str = ""

    @classmethod
    def from_reply(cls, node_id: int, reply: ProfileReply) -> NodeProfile:
        """The profile a node sent in its ``query`` reply (``variant`` ``""``: declined)."""
        return cls(
            node_id=node_id,
            tier=reply.tier,
            memory_mb=reply.memory_mb,
            num_examples=reply.num_examples,
            labeled=reply.labeled,
            variant=reply.variant or None,
            reason=reply.reason,
            key=reply.node_key,
        )

    @property
    def stable_key(self) -> str:
        """Identity that survives a restart: the node's ``node-key`` (e.g. ``partition-3``), else its id.

        Simulation gives nodes new random ids in every run; per-node server state is matched
        to the restarted node through this key when a run resumes.
        """
        return self.key or f"node-{self.node_id}"

    @property
    def sampling_order(self) -> tuple[int, tuple[tuple[int, int | str], ...], int]:
        """Where the node stands when a round's sample is drawn: by its ``node-key``, else by its id.

        Keys sort naturally (``partition-2`` before ``partition-10``); nodes without a key come
        first, by id. Simulation gives nodes new random ids in every run: drawing from the nodes in
        key order lets the same seed sample the same partitions in every run (paired comparisons).
        """
        if not self.key:
            return (0, (), self.node_id)
        parts = re.split(r"(\d+)", self.key)
        return (1, tuple((0, int(t)) if t.isdigit() else (1, t) for t in parts), 0)

"""The handshake: what every node reports before it is sent work, and what the server concludes.

Every node not seen before gets a ``query`` message carrying the published catalog (variant
names, estimated training memory, whether memory is ignored) and answers with its profile:
tier, memory budget, examples, the variant it chose or the reason it declined
(:class:`strategies.profiles.NodeProfile`).  From the profiles the server warns about a variant
no node chose (:func:`unchosen_variant_warnings`) and stops a run that no connected node can
train (:class:`NothingToTrain`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from logging import INFO, WARNING

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from experiment.protocol import CATALOG, PROFILE, CatalogOffer, ProfileReply, ProtocolError, record_of
from strategies.profiles import NodeProfile


class NothingToTrain(RuntimeError):
    """Every connected node declined to train: the run would train nothing."""


def nothing_to_train_message(server_round: int, declined: Sequence[tuple[str, str]]) -> str:
    """The error of a round no node can train: the nodes' reasons per tier and the keys that fix them.

    ``declined`` holds ``(tier, reason)`` per node.  A reason about memory points at
    ``tier-memory-mb`` / ``runtime-overhead-mb`` (emulated budgets) or the node's ``memory-mb``;
    one about data at the partitioning keys.
    """
    by_reason: dict[tuple[str, str], int] = {}
    for tier, reason in declined:
        by_reason[(tier, reason)] = by_reason.get((tier, reason), 0) + 1
    lines = "; ".join(f"{n} x tier {tier}: {reason}" for (tier, reason), n in by_reason.items())
    fixes = []
    text = " ".join(r for _, r in declined).lower()
    if "memory" in text or "budget" in text:
        fixes.append(
            "give the tiers budgets their variants fit (run config 'tier-memory-mb', e.g. \"auto\" in simulation, "
            "or a lower 'runtime-overhead-mb'; on a device its node config 'memory-mb') or a smaller 'model'"
        )
    if "no local data" in text:
        fixes.append("check the data keys the reason names ('dataset', 'partitioner', 'dirichlet-alpha')")
    fix = ("; " + "; ".join(fixes)) if fixes else ""
    return f"nothing to train in round {server_round}: all {len(declined)} connected nodes declined ({lines}){fix}"


def check_someone_can_train(server_round: int, profiles: Sequence[NodeProfile | None]) -> None:
    """Raise :class:`NothingToTrain` when every connected node answered the handshake and declined.

    ``profiles`` holds each connected node's profile (``None``: it has not answered).  A round
    with no node to train would run, train nothing and write results as if it had; where each
    node has said why it cannot train (its budget fits no variant, it has no data), no later
    round can do better, so the run stops here with the nodes' reasons.  Nodes that have not
    answered (yet) leave the run going: a deployment may still gain them.
    """
    declined = [p for p in profiles if p is not None and p.variant is None]
    if not declined or len(declined) < len(profiles):
        return
    raise NothingToTrain(nothing_to_train_message(server_round, [(p.tier, p.reason) for p in declined]))


def query_profiles(
    grid: Grid, node_ids: Sequence[int], offer: CatalogOffer, variants: Collection[str], timeout: float
) -> Iterator[tuple[int, NodeProfile]]:
    """Send the catalog offer to ``node_ids``; yield ``(node, profile)`` per well-formed reply, in reply order.

    A node whose reply is an error or a malformed profile is skipped with a logged warning (it is
    asked again at the next round's handshake); a chosen variant not in ``variants`` is cleared
    (the node counts as declined).  Each reply is parsed when the caller asks for the next one, so
    the caller's own log lines for a node come before the next reply's.
    """
    content = offer.to_record()
    msgs = [Message(RecordDict({CATALOG: content}), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    by_id = {m.metadata.message_id: m.metadata.dst_node_id for m in msgs}
    for reply in replies:
        node = by_id.get(reply.metadata.reply_to_message_id)
        if node is None:
            continue
        if reply.has_error():
            log(WARNING, "node %s failed the handshake: %s", node, reply.error.reason)
            continue
        try:
            profile = NodeProfile.from_reply(
                node, ProfileReply.from_record(record_of(reply.content, PROFILE, ConfigRecord))
            )
        except ProtocolError as exc:
            log(WARNING, "node %s answered the handshake with a malformed profile (%s): ignored", node, exc)
            continue
        if profile.variant is not None and profile.variant not in variants:
            log(WARNING, "node %s chose unknown variant %r: ignored", node, profile.variant)
            profile.variant = None
        yield node, profile


def unchosen_variant_warnings(
    variants: Sequence[str], profiles: Iterable[NodeProfile], already: Sequence[str]
) -> list[str]:
    """A warning per variant of a multi-variant catalog that no node chose (and none warned of yet).

    The pre-flight check of the launcher (:mod:`experiment.preflight`) predicts this from the
    run config; here it is what the connected nodes reported, for ``flwr run`` users too.  Such a
    variant is never trained: the run is less heterogeneous than its tiers say.  ``already``
    holds the warnings given before (one per variant, ever).
    """
    chosen_by = [p.variant for p in profiles]
    if len(variants) < 2 or not chosen_by:
        return []
    out = []
    for variant in variants:
        warned = any(w.startswith(f"variant {variant!r} ") for w in already)
        if variant in chosen_by or warned:
            continue
        tally = Counter("declined" if c is None else c for c in chosen_by)
        counts = ", ".join(f"{v}: {n}" for v, n in sorted(tally.items()))
        out.append(
            f"variant {variant!r} trains on no node: the {len(chosen_by)} nodes so far chose ({counts}); "
            "in simulation tier-memory-mb='auto' gives each tier its own variant"
        )
    return out


def wait_for_nodes(grid: Grid, minimum: int) -> list[int]:
    """The connected nodes, once at least ``minimum`` are (polled every second, logged every 30 s)."""
    waited = 0
    while len(nodes := list(grid.get_node_ids())) < minimum:
        if waited % 30 == 0:
            log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), minimum)
        time.sleep(1)
        waited += 1
    return nodes


def log_profile(node: int, profile: NodeProfile) -> None:
    """One line per answered query: the node's tier and variant, or why it declined."""
    if profile.variant is None:
        log(WARNING, "node %s (tier %s) declined: %s", node, profile.tier, profile.reason)
    else:
        log(INFO, "node %s: tier %s, %.0f MiB -> %s", node, profile.tier, profile.memory_mb, profile.variant)

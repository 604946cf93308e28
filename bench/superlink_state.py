"""What one registered node costs Flower 1.39's SuperLink: state per node and work per request.

Builds Flower's own link state (``LinkStateFactory`` on a SQLite file, as ``flower-superlink
--database FILE`` does) with ``N`` nodes carrying real-length SECP384R1 public keys, then times
the state calls behind the Fleet API requests every node makes (medians over ``--calls``):

* ``acknowledge_node_heartbeat`` (``SendNodeHeartbeat``, every 17.5-22.5 s per node),
* ``get_message_ins(limit=1)`` with nothing queued (an idle ``PullMessages``: every 3 s per
  node with ``flower-supernode``, every ``HETFL_SUPERNODE_IDLE_S`` with ``client.supernode``),
* ``get_node_id_by_public_key`` and one ECDSA P-384 signature check (what the SuperNode-auth
  interceptor adds to every request),
* ``get_node_info(statuses=[ONLINE])`` and Flower's ``Runtime.GetNodes`` (what ``Grid.get_node_ids``
  asks for, twice a round: the online nodes, then their infos by id, one SQL variable per node),
  and whether that second query fails for 250,001 nodes (SQLite's limit on variables),

and the database bytes per node.  No gRPC, TLS or protobuf cost is included: these are lower
bounds on the SuperLink's work per request.  docs/DEPLOYING.md ("A million devices") derives
the SuperLink's capacity from them.

Run ``python -m bench.superlink_state [--nodes 1000] [--calls 500] [--json OUT]``; ``--smoke``
uses 20 nodes and 5 calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import write_report


def median_ms(call: Callable[[int], object], times: int) -> float:
    """Median wall time of ``call(i)`` for ``i`` in ``range(times)``, milliseconds."""
    spent = []
    for i in range(times):
        t0 = time.perf_counter()
        call(i)
        spent.append(time.perf_counter() - t0)
    return statistics.median(spent) * 1e3


def _in_list_fails(state: Any, count: int) -> bool:
    """Whether Flower's ``get_node_info(node_ids=...)`` with ``count`` ids fails (SQLite's variable limit)."""
    from sqlalchemy.exc import OperationalError

    try:
        state.get_node_info(node_ids=list(range(1, count + 1)))
    except OperationalError as exc:  # "too many SQL variables"
        print(f"get_node_info with {count} ids: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return True
    return False


def measure(nodes: int, calls: int, folder: Path) -> dict[str, float]:
    """The per-call medians (ms) and bytes per node of a state database with ``nodes`` nodes."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.server.superlink.linkstate import LinkStateFactory
    from flwr.supercore.constant import NodeStatus
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supercore.primitives.asymmetric import (
        generate_key_pairs,
        public_key_to_bytes,
        sign_message,
        verify_signature,
    )
    from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager

    db = str(folder / "state.db")
    state: Any = LinkStateFactory(db, NoOpFederationManager(), ObjectStoreFactory(db)).state()
    private, public = generate_key_pairs()
    key = public_key_to_bytes(public)
    t0 = time.perf_counter()
    ids = [state.create_node("<none>", "<none>", key[:-80] + os.urandom(40).hex().encode(), 30.0) for _ in range(nodes)]
    create = (time.perf_counter() - t0) / nodes * 1e3
    signed = b"2026-11-26T12:00:00.000000+00:00"
    signature = sign_message(private, signed)
    out = {
        "nodes": float(nodes),
        "create_node_ms": create,
        "activate_node_ms": median_ms(lambda i: state.activate_node(ids[i % nodes], 30.0), nodes),
        "heartbeat_ms": median_ms(lambda i: state.acknowledge_node_heartbeat(ids[i % nodes], 30.0), calls),
        "idle_pull_ms": median_ms(lambda i: state.get_message_ins(ids[i % nodes], limit=1), calls),
        "key_lookup_ms": median_ms(lambda i: state.get_node_id_by_public_key(key), calls),
        "verify_signature_ms": median_ms(lambda i: verify_signature(public, signed, signature), calls),
        "list_online_ms": median_ms(lambda i: state.get_node_info(statuses=[NodeStatus.ONLINE]), max(3, calls // 50)),
        # Runtime.GetNodes (Grid.get_node_ids): the online nodes, then their infos by id (one SQL variable each)
        "get_nodes_ms": median_ms(
            lambda i: state.get_node_info(
                node_ids=[n.node_id for n in state.get_node_info(statuses=[NodeStatus.ONLINE])]
            ),
            max(3, calls // 50),
        ),
        "in_list_of_250001_ids_fails": float(_in_list_fails(state, 250_001)),
    }
    wal = Path(db + "-wal")
    out["db_bytes_per_node"] = (Path(db).stat().st_size + (wal.stat().st_size if wal.exists() else 0)) / nodes
    out["load_1min"] = os.getloadavg()[0]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="20 nodes, 5 calls")
    args = parser.parse_args(argv)
    nodes, calls = (20, 5) if args.smoke else (args.nodes, args.calls)
    with tempfile.TemporaryDirectory(prefix="superlink-state-") as tmp:
        result = measure(nodes, calls, Path(tmp))
    for name, value in result.items():
        print(f"{name:>22} {value:10.3f}")
    write_report(args.json, {"superlink_state": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

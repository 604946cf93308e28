"""The chaos suite's fault makers (deploy/chaos.py): nftables loss rules, the delaying relay."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.chaos import Delay, DelayRelay, dropped_packets, loss_ruleset, read_rows, release_times, set_loss
from deploy.netns import HostNetwork, namespaces_available


def test_the_loss_ruleset_drops_each_way_on_every_interface_but_loopback() -> None:
    assert loss_ruleset(5) == (
        "table inet hetfl_chaos\n"
        "delete table inet hetfl_chaos\n"
        "table inet hetfl_chaos {\n"
        "  chain inbound {\n"
        "    type filter hook input priority 0; policy accept;\n"
        '    iifname != "lo" numgen random mod 100 < 5 counter drop\n'
        "  }\n"
        "  chain outbound {\n"
        "    type filter hook output priority 0; policy accept;\n"
        '    oifname != "lo" numgen random mod 100 < 5 counter drop\n'
        "  }\n"
        "}\n"
    )
    assert "drop" not in loss_ruleset(0)
    assert '"lo" counter drop' in loss_ruleset(100)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        loss_ruleset(101)


def test_chunks_are_released_after_their_hold_and_never_out_of_order() -> None:
    # the second chunk draws a shorter hold than the first: it waits for the first
    assert release_times([0.0, 0.01, 0.5], [0.13, 0.07, 0.1]) == [0.13, 0.13, 0.6]
    rng = random.Random(0)
    holds = [Delay(100, 30).draw(rng) for _ in range(1000)]
    assert min(holds) >= 0.07 and max(holds) <= 0.13
    assert abs(sum(holds) / len(holds) - 0.1) < 0.003
    with pytest.raises(ValueError, match="jitter"):
        Delay(10, 30)


def test_the_relay_delays_each_way_and_keeps_every_byte_in_order(tmp_path: Path) -> None:
    settings = tmp_path / "delay.json"
    Delay(60, 10).write(settings)
    payload = bytes(random.Random(1).getrandbits(8) for _ in range(300_000))

    async def scenario() -> tuple[bytes, float, float]:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = upstream.sockets[0].getsockname()[:2]
        relay = DelayRelay(("127.0.0.1", 0), target, settings, seed=3)
        server = await asyncio.start_server(relay._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]

        async def round_trip(data: bytes) -> tuple[bytes, float]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.perf_counter()
            writer.write(data)
            writer.write_eof()
            got = await reader.read(-1)
            writer.close()
            return got, time.perf_counter() - t0

        got, slow = await round_trip(payload)
        Delay().write(settings)
        await asyncio.sleep(0.05)
        settings.touch()
        _, fast = await round_trip(b"ping")
        server.close()
        upstream.close()
        return got, slow, fast

    got, slow, fast = asyncio.run(scenario())
    assert got == payload
    assert slow >= 2 * 0.05  # at least one hold each way (60 ± 10 ms)
    assert fast < slow  # the settings file was re-read: no delay now


#: Counts the UDP datagrams that reach ``sys.argv[1]:9999`` within 2 s of the first (or 3 s of none).
RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 9999))
s.settimeout(3.0)
n = 0
try:
    while True:
        s.recv(64)
        n += 1
        s.settimeout(2.0)
except socket.timeout:
    pass
print(n)
"""
SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(40):
    try:
        s.sendto(b"x", (sys.argv[1], 9999))
    except PermissionError:  # an output rule dropped it: the sender is told
        pass
    time.sleep(0.005)
"""


def _delivered(net: HostNetwork) -> int:
    receiver = subprocess.Popen(
        [*net.prefix(net.server), sys.executable, "-c", RECEIVER, net.server_address(0)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    subprocess.run([*net.prefix(net.node(0)), sys.executable, "-c", SENDER, net.server_address(0)], check=True)
    out, _ = receiver.communicate(timeout=30)
    return int(out)


@pytest.mark.chaos
def test_loss_rules_drop_packets_inside_a_namespace_only() -> None:
    reason = namespaces_available(("ip", "nft"))
    if reason is not None:
        pytest.fail(f"the chaos suite needs network namespaces and nftables: {reason} (`make chaos-tools` as root)")
    with HostNetwork(nodes=1) as net:
        node = net.prefix(net.node(0))
        set_loss(node, 100)
        assert _delivered(net) == 0
        assert dropped_packets(node) >= 40
        set_loss(node, 0)
        assert _delivered(net) == 40
        assert dropped_packets(node) == 0


def test_read_rows_skips_only_a_last_line_being_written(tmp_path: Path) -> None:
    assert read_rows(tmp_path) == []  # no rounds.jsonl yet
    (tmp_path / "rounds.jsonl").write_text('{"round": 0}\n{"round": 1}\n{"rou')
    assert read_rows(tmp_path) == [{"round": 0}, {"round": 1}]
    (tmp_path / "rounds.jsonl").write_text('{"round": 0}\n{"rou\n{"round": 2}\n')
    with pytest.raises(ValueError):
        read_rows(tmp_path)

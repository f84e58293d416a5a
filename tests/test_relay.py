"""The relay on 127.0.0.1 without hivemind: reservations, tunnels that carry whole streams both ways, probes."""

from __future__ import annotations

import hashlib
import logging
import signal
import socket
import subprocess
import sys
import threading

import pytest

from p2p_diloco.net.bootstrap import advice
from p2p_diloco.net.quiet_logs import quiet_hivemind
from p2p_diloco.net.reachability import dialable, relay_hosts
from p2p_diloco.net.relay import RelayClient, RelayServer, probe


@pytest.fixture
def echo_port():
    """A TCP echo server standing in for an island's p2pd."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return

            def echo(connection=connection) -> None:
                with connection:
                    while data := connection.recv(1 << 16):
                        connection.sendall(data)

            threading.Thread(target=echo, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def relay():
    server = RelayServer("127.0.0.1").start()
    yield server
    server.stop()


def roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        threading.Thread(target=lambda: (connection.sendall(payload), connection.shutdown(socket.SHUT_WR))).start()
        chunks = []
        while data := connection.recv(1 << 18):
            chunks.append(data)
    return b"".join(chunks)


def test_a_tunnel_carries_megabytes_both_ways_and_several_visitors(relay, echo_port) -> None:
    client = RelayClient(("127.0.0.1", relay.port), "island-a", echo_port)
    try:
        public = client.start()
        assert public != echo_port and client.observed == "127.0.0.1" and relay.reservations == 1
        payload = bytes(range(256)) * (20 * 4096)  # 20 MiB: far past what a libp2p circuit relay lets through
        assert hashlib.sha256(roundtrip(public, payload)).digest() == hashlib.sha256(payload).digest()
        results = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(roundtrip(public, bytes([i]) * 100_000)))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(results) == sorted(bytes([i]) * 100_000 for i in range(4))
    finally:
        client.stop()


def test_a_reservation_ends_with_the_island(relay, echo_port) -> None:
    client = RelayClient(("127.0.0.1", relay.port), "island-b", echo_port)
    public = client.start()
    client.stop()
    for _ in range(50):
        if relay.reservations == 0:
            break
        threading.Event().wait(0.1)  # the relay notices the closed control connection asynchronously
    assert relay.reservations == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", public), timeout=2).recv(1)


def test_probes_dial_back_only_the_asker(relay, echo_port) -> None:
    assert probe(("127.0.0.1", relay.port), echo_port) == (True, "127.0.0.1")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    assert probe(("127.0.0.1", relay.port), closed_port) == (False, "127.0.0.1")
    assert probe(("127.0.0.1", 1), echo_port) == (False, None)  # no relay there at all


def test_a_full_or_probe_only_relay_refuses_reservations(echo_port) -> None:
    for server, reason in [
        (RelayServer("127.0.0.1", max_islands=0), r"relay full \(0 islands\)"),
        (RelayServer("127.0.0.1", reservations=False), "does not relay"),
    ]:
        server.start()
        try:
            with pytest.raises(OSError, match=reason):
                RelayClient(("127.0.0.1", server.port), "island-c", echo_port).start()
            assert probe(("127.0.0.1", server.port), echo_port)[0]  # it still answers probes
        finally:
            server.stop()


def test_addresses_to_give_out_and_bootstrap_advice() -> None:
    own = ["/ip4/127.0.0.1/tcp/5", "/ip4/10.1.2.3/tcp/5", "/ip4/8.8.4.4/tcp/5", "/ip4/8.8.4.4/udp/5/quic-v1"]
    assert dialable(own) == ["/ip4/8.8.4.4/tcp/5", "/ip4/8.8.4.4/udp/5/quic-v1", "/ip4/10.1.2.3/tcp/5"]
    assert dialable(["/ip4/127.0.0.1/tcp/5"]) == ["/ip4/127.0.0.1/tcp/5"]  # a local swarm keeps loopback
    assert relay_hosts(own) == ["8.8.4.4", "10.1.2.3", "127.0.0.1"]
    warning = advice(["/ip4/10.0.0.5/tcp/31337/p2p/X"], announced=False)
    assert "islands outside this network cannot reach it" in warning
    assert "--announce-maddrs /ip4/<public IP>/tcp/31337" in warning and "\n" not in warning
    assert advice(["/ip4/10.0.0.5/tcp/31337/p2p/X"], announced=True) is None
    assert advice(["/ip4/8.8.4.4/tcp/31337/p2p/X"], announced=False) is None


def test_hivemind_round_failures_become_one_debug_line(caplog: pytest.LogCaptureFixture) -> None:
    quiet_hivemind()
    logger = logging.getLogger("hivemind.averaging.averager")
    with caplog.at_level(logging.DEBUG, logger="hivemind.averaging.averager"):
        try:
            raise RuntimeError("Averaging step failed: could not find a group")
        except RuntimeError as error:
            logger.exception(error)
        logger.error("something else went wrong")
        logger.warning("DecoupledAverager caught AllreduceException('partial all-reduce'), retrying")
    records = [(r.levelname, r.exc_info) for r in caplog.records if r.name == "hivemind.averaging.averager"]
    assert records == [("DEBUG", None), ("ERROR", None), ("INFO", None)]  # a retry says why, in one line


SCRIPT = """
import signal, sys, time
from p2p_diloco.signals import GracefulStop
stop = GracefulStop("probe").install()
with stop.deferred():
    print("ready", flush=True)
    while not stop.wait(0.05):
        pass
    print("safe point", stop.name, flush=True)
    if len(sys.argv) > 2:  # a main thread that cannot take the signal, as inside a long C call or on another thread
        signal.pthread_sigmask(signal.SIG_BLOCK, [stop.signum])
    time.sleep(float(sys.argv[1]))  # the safe stop takes this long
sys.exit(stop.exit_code)
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_asks_the_second_stops_at_once(sig: int, code: int) -> None:
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, "0"], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(sig)
    assert process.wait(10) == code
    assert process.stdout.read().split() == ["safe", "point", signal.Signals(sig).name]
    for blocked in ([], ["blocked"]):
        slow = subprocess.Popen([sys.executable, "-c", SCRIPT, "60", *blocked], stdout=subprocess.PIPE, text=True)
        try:
            assert slow.stdout.readline().strip() == "ready"
            slow.send_signal(sig)
            assert slow.stdout.readline().startswith("safe point")
            slow.send_signal(sig)
            assert slow.wait(10) == code, blocked  # did not wait for the 60 s safe stop
        finally:
            slow.kill()
            slow.wait()


FORKING = """
import multiprocessing, os, signal, subprocess, sys
from p2p_diloco.signals import GracefulStop
stop = GracefulStop("probe").install()

def child():
    os.kill(os.getpid(), signal.SIGTERM)  # a hivemind child's own signal: never the parent's second one
    pipes = [os.pipe() for _ in range(3)]  # fd numbers the parent's watcher holds, free in this child
    for reader, writer in pipes:  # p2pd is started like this, from hivemind's forked DHT process
        subprocess.run([sys.executable, "-c", "print(1)"], stdout=writer, preexec_fn=lambda: None, check=True)

with stop.deferred():
    for _ in range(2):
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join()
        assert process.exitcode == 0, process.exitcode
    print("alive", stop.requested, flush=True)
"""


def test_forked_children_neither_count_as_a_second_signal_nor_lose_their_fds() -> None:
    done = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["alive", "False"], done.stderr[-2000:]

"""`p2p-diloco dashboard`: a live web page of a run, built from the DHT records its islands announce.

No central server is involved in training: the dashboard is one more DHT reader (a client-mode node). It polls
the run's records, keeps every island's recent rounds as they go by (each record carries only the last few), and
serves the page (`dashboard.html`, no external scripts) and `/api/status` (the `status --json` summary with the
accumulated history) on `--host:--port`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from p2p_diloco.cli.logs import setup_logging
from p2p_diloco.cli.status import add_swarm_flags, observer_membership, target
from p2p_diloco.config import NetworkConfig
from p2p_diloco.errors import UserError
from p2p_diloco.signals import GracefulStop, Stopped

logger = logging.getLogger(__name__)

MAX_ROUNDS = 2000
"""Rounds kept per island (older ones are dropped)."""


class History:
    """Every round the dashboard has seen of each island, from the short histories in their records."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rounds: dict[str, dict[int, list[Any]]] = {}
        self.latest: dict[str, Any] = {"islands": [], "clock": 0, "total_tokens": 0}

    def update(self, summary: dict[str, Any]) -> None:
        """Fold a fresh `status` summary in."""
        with self.lock:
            for island in summary["islands"]:
                rounds = self.rounds.setdefault(island["peer_id"], {})
                for entry in island.get("history") or []:
                    if isinstance(entry, list) and entry and isinstance(entry[0], int):
                        rounds[entry[0]] = entry
                while len(rounds) > MAX_ROUNDS:
                    del rounds[min(rounds)]
            self.latest = summary

    def snapshot(self) -> dict[str, Any]:
        """The latest summary, each island with every round seen so far."""
        with self.lock:
            islands = [
                {
                    **island,
                    "history": [
                        self.rounds[island["peer_id"]][step] for step in sorted(self.rounds.get(island["peer_id"], {}))
                    ],
                }
                for island in self.latest["islands"]
            ]
            return {**self.latest, "islands": islands}


def _handler(history: History, page: bytes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            if self.path.split("?")[0] == "/api/status":
                body, kind = json.dumps(history.snapshot()).encode(), "application/json"
            elif self.path.split("?")[0] in ("/", "/index.html"):
                body, kind = page, "text/html; charset=utf-8"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format % args)

    return Handler


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `dashboard` subcommand."""
    dashboard = commands.add_parser("dashboard", help="a live web page of a run: losses, merges, resyncs, bandwidth")
    add_swarm_flags(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)")
    dashboard.add_argument("--port", type=int, default=8080, help="port to serve the page on (default 8080)")
    dashboard.add_argument("--interval", type=float, default=2.0, help="seconds between DHT reads (default 2)")


def run(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C or SIGTERM."""
    from p2p_diloco.net.observer import Observer, summary

    stop = GracefulStop("p2p-diloco dashboard").install()
    try:
        peers, run_id = target(args)
        setup_logging(args.log_level)
        page = resources.files("p2p_diloco.cli").joinpath("dashboard.html").read_bytes()
        history = History()
        try:
            server = ThreadingHTTPServer((args.host, args.port), _handler(history, page))
        except OSError as error:
            where = f"{args.host}:{args.port}"
            raise UserError(f"cannot serve on {where} ({error.strerror}); pass another --port") from None
        ttl = NetworkConfig().announce_ttl
        with Observer(
            peers, timeout=args.join_timeout, membership=observer_membership(args), identity=args.identity
        ) as observer:
            threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
            print(f"dashboard of run {run_id} at http://{args.host}:{server.server_address[1]}/", flush=True)
            with stop.deferred():
                while not stop.requested:
                    try:
                        history.update(summary(run_id, observer.islands(run_id), ttl))
                    except Exception as error:  # a slow DHT read only delays the page's next update
                        logger.warning(f"could not read run {run_id!r} from the DHT: {error!r}")
                    stop.wait(args.interval)
            server.shutdown()
    except UserError as error:
        print(f"p2p-diloco dashboard: error: {error}", file=sys.stderr)
        return error.exit_code
    except Stopped as stopped:
        return stopped.exit_code
    return stop.exit_code

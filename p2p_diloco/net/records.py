"""The run's records in the DHT: each island announces itself under `{run_id}.islands` and reads the others.

Each island writes one subkey, named after its identity key (`[owner:ssh-rsa ...]`), which only that key can
sign (hivemind's RSASignatureValidator, installed on every node). On read, a record counts only if it is signed
that way, names the peer id of its own key, expires soon enough and passes the schema (`record_schema`); anything
else is dropped and counted, never half-trusted. No single record can refuse a join: an island is refused for its
model, codec or protocol only when no live island of the run announces the same as it does.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPublicKey

from p2p_diloco.errors import UserError
from p2p_diloco.net.codecs import describe_strangers, strangers
from p2p_diloco.net.dht import OrphanFreeDHT
from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.record_schema import MAX_EXPIRATION_S, problem

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 4
"""The wire protocol of p2p-diloco islands: records, gathered metadata, averaging schema, parts, state transfer.
Islands of different protocol versions never average and refuse each other at join. 4: top-k positions as
Golomb-Rice codes instead of varints."""
RUNS_KEY = "p2p-diloco.runs"
"""DHT key where islands register their run (one subkey per run id): what `p2p-diloco swarms` lists."""
_OWNER = re.compile(rb"^\[owner:(.+)\]$")


class ModelMismatchError(UserError):
    """Another island of the same run trains a different model or uses another codec."""


class ProtocolMismatchError(ModelMismatchError):
    """An island of the run speaks another wire protocol (another p2p-diloco version)."""


def records_key(run_id: str) -> str:
    """The DHT key under which the islands of a run announce themselves (one subkey per island)."""
    return f"{run_id}.islands"


def owner_subkey(identity_key: Any) -> bytes:
    """The subkey an identity key signs its record under."""
    return RSASignatureValidator(identity_key).local_public_key


def verified(subkey: Any, value: Any, expiration: float, now: float) -> str | None:
    """Why a record under a run's key is not an island's own (None: it is)."""
    match = _OWNER.match(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return "it is not signed by an owner key"
    if expiration > now + MAX_EXPIRATION_S:
        return f"it claims to live {expiration - now:.0f}s more"
    if (why := problem(value)) is not None:
        return why
    try:
        owner = peer_id_of(RSAPublicKey.from_bytes(match.group(1))).to_base58()
    except ValueError:
        return "its owner key does not parse"
    if value.get("peer_id") != owner:
        return f"it names peer {value.get('peer_id')} but is signed by {owner}"
    return None


class RunRecords:
    """This island's record under the run id, and what the other live islands of the run announced."""

    def __init__(
        self, dht: OrphanFreeDHT, run_id: str, peer_id: str, *, ttl: float, timeout: float, owner: bytes | None = None
    ):
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.ttl, self.timeout = ttl, timeout
        self.owner = owner if owner is not None else owner_subkey(dht.identity_key)
        self.ignored = 0
        """Records dropped so far (unsigned, foreign-signed, malformed or claiming to live too long)."""
        self._reported: set[str] = set()

    def read(self) -> dict[str, dict[str, Any]]:
        """Every live island's verified record (this one's included), by peer id."""
        found = self.dht.get(records_key(self.run_id), latest=True, return_future=True).result(timeout=self.timeout)
        entries = (found.value if found is not None else None) or {}
        now = get_dht_time()
        records = {}
        for subkey, item in entries.items() if isinstance(entries, dict) else []:
            value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", 0.0)
            why = verified(subkey, value, expiration, now)
            if why is None:
                records[value["peer_id"]] = value
                continue
            self.ignored += 1
            label = value.get("peer_id") if isinstance(value, dict) else None
            if (key := f"{label}:{why}") not in self._reported:
                self._reported.add(key)
                logger.warning(f"ignoring a record of run {self.run_id!r} (peer {label}): {why}")
        return records

    def announce(self, info: dict[str, Any], *, check: bool) -> dict[str, dict[str, Any]]:
        """Announce this island and return the others; with `check`, refuse a run of another model or codec."""
        others = {peer: data for peer, data in self.read().items() if peer != self.peer_id}
        if check:
            refuse_strangers(self.run_id, info, others)
        expiration = get_dht_time() + self.ttl
        stored = self.dht.store(
            records_key(self.run_id),
            subkey=self.owner,
            value={**info, "peer_id": self.peer_id},
            expiration_time=expiration,
            return_future=True,
        )
        summary = {key: info.get(key) for key in ("fingerprint", "codec", "outer_step", "protocol")}
        registered = self.dht.store(
            RUNS_KEY,
            subkey=self.run_id,
            value={**summary, "islands": len(others) + 1},
            expiration_time=expiration,
            return_future=True,
        )
        stored.result(timeout=self.timeout)
        registered.result(timeout=self.timeout)
        return others


MIN_AGREEING_STRANGERS = 2
"""Distinct islands that must announce the same other protocol or model before a join is refused: one peer's word
(a forged record, a misconfigured stranger) only ever costs a warning."""


def _largest_agreeing(others: dict[str, dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    """The peers of the largest group of `others` that announce the same values of `keys`."""
    groups: dict[tuple, list[str]] = {}
    for peer, data in others.items():
        groups.setdefault(tuple(str(data.get(key)) for key in keys), []).append(peer)
    return max(groups.values(), key=len, default=[])


def refuse_strangers(run_id: str, info: dict[str, Any], others: dict[str, dict[str, Any]]) -> None:
    """Refuse to join when several islands and none of ours agree on another protocol, model or codec; else warn."""
    if not others:
        return
    alike = {peer: data for peer, data in others.items() if data.get("protocol") == info.get("protocol")}
    if not alike and len(agreeing := _largest_agreeing(others, ("protocol",))) >= MIN_AGREEING_STRANGERS:
        data = others[agreeing[0]]
        raise ProtocolMismatchError(
            f"protocol mismatch: islands {', '.join(sorted(agreeing))} of run {run_id!r} speak p2p-diloco wire "
            f"protocol {data.get('protocol', 0)} (version {data.get('version', 'unknown')}), this island speaks "
            f"{info.get('protocol')} (version {info.get('version')}); run the swarm's p2p-diloco version"
        )
    for peer, data in others.items():
        if peer not in alike:
            logger.warning(
                f"run {run_id!r}: island {peer} speaks wire protocol {data.get('protocol')!r} (version "
                f"{data.get('version', 'unknown')}), this island {info.get('protocol')} (version "
                f"{info.get('version')}): not averaging with it; islands of one run need the same p2p-diloco version"
            )
    found = strangers(info, alike)
    if not found:
        return
    agreeing = _largest_agreeing({peer: alike[peer] for peer in found}, ("fingerprint", "codec"))
    if len(found) < len(alike) or len(agreeing) < MIN_AGREEING_STRANGERS:
        logger.warning(f"run {run_id!r}: {describe_strangers(info, found)}; not averaging with them")
        return
    names = ", ".join(sorted(agreeing))
    model = str(alike[agreeing[0]].get("fingerprint"))
    if model != str(info.get("fingerprint")):
        raise ModelMismatchError(
            f"model mismatch: run {run_id!r} already trains model {model} (islands {names}), this island's "
            f"model is {info['fingerprint']}; use the swarm's [model] config or another --run-id"
        )
    raise ModelMismatchError(
        f"codec mismatch: run {run_id!r} exchanges pseudo-gradients as {alike[agreeing[0]].get('codec')} (islands "
        f"{names}), this island uses {info.get('codec')!r}; every island of a run must use the same --codec"
    )

"""The run's records in the DHT: each island announces itself under `{run_id}.islands` and reads the others."""

from __future__ import annotations

from typing import Any

from hivemind.utils import get_dht_time

from p2p_diloco.errors import UserError
from p2p_diloco.net.codecs import strangers
from p2p_diloco.net.dht import OrphanFreeDHT


class ModelMismatchError(UserError):
    """Another island of the same run trains a different model or uses another codec."""


def records_key(run_id: str) -> str:
    """The DHT key under which the islands of a run announce themselves (one subkey per island)."""
    return f"{run_id}.islands"


class RunRecords:
    """This island's record under the run id, and what the other live islands of the run announced."""

    def __init__(self, dht: OrphanFreeDHT, run_id: str, peer_id: str, *, ttl: float, timeout: float):
        self.dht, self.run_id, self.peer_id = dht, run_id, peer_id
        self.ttl, self.timeout = ttl, timeout

    def read(self) -> dict[str, dict[str, Any]]:
        """Every live island's record (this one's included), by peer id."""
        found = self.dht.get(records_key(self.run_id), latest=True, return_future=True).result(timeout=self.timeout)
        entries = found.value if found is not None else {}
        return {
            str(subkey): item.value
            for subkey, item in (entries or {}).items()
            if isinstance(getattr(item, "value", None), dict)
        }

    def announce(self, info: dict[str, Any], *, check: bool) -> dict[str, dict[str, Any]]:
        """Announce this island and return the others; with `check`, refuse a run of another model or codec."""
        others = {peer: data for peer, data in self.read().items() if peer != self.peer_id}
        if check:
            self._refuse_strangers(info, others)
        self.dht.store(
            records_key(self.run_id),
            subkey=self.peer_id,
            value=info,
            expiration_time=get_dht_time() + self.ttl,
            return_future=True,
        ).result(timeout=self.timeout)
        return others

    def _refuse_strangers(self, info: dict[str, Any], others: dict[str, dict[str, Any]]) -> None:
        found = strangers(info, others)
        foreign = sorted({str(d["fingerprint"]) for d in found.values() if "fingerprint" in d})
        codecs = sorted({str(d["codec"]) for d in found.values() if "codec" in d})
        if foreign:
            raise ModelMismatchError(
                f"model mismatch: run {self.run_id!r} already trains model {', '.join(foreign)}, this island's model "
                f"is {info['fingerprint']}; use the swarm's [model] config or another --run-id"
            )
        if codecs:
            raise ModelMismatchError(
                f"codec mismatch: run {self.run_id!r} exchanges pseudo-gradients as {', '.join(codecs)}, this island "
                f"uses {info.get('codec')!r}; every island of a run must use the same --codec"
            )

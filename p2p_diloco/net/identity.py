"""Peer identities: the RSA key a peer id is made from, loaded from hivemind's identity files.

p2p-diloco runs every DHT node with an RSA identity (hivemind writes one when `identity_path` does not exist):
the same key then names the peer (its peer id is the hash of the public key), signs its DHT records and, in a
private swarm, proves its membership token is its own. An island started without `--identity` gets a fresh key in
a temporary file.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.errors import UserError


class IdentityError(UserError):
    """An identity file that cannot be used."""


_GENERATED_HERE: set[str] = set()
"""Identity files this process generated. A fresh RSA key is nobody else's: hivemind's check that no running peer
holds an identity (a second p2pd started and bootstrapped only to dial the key's peer id) is pointless for them, as
hivemind itself skips it for the keys it generates. It doubled P2P.create's time on an idle machine (0.35 s against
0.17 s) and runs inside every restarted island's join, a standby's after its takeover included."""


def ensure_identity(path: str | os.PathLike | None) -> str:
    """The identity file to run with: `path` (created if missing), or a fresh one removed at exit."""
    if path is None:
        folder = tempfile.mkdtemp(prefix="p2p-diloco-identity-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        path = Path(folder) / "identity.key"
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
        _GENERATED_HERE.add(str(path))
    return str(path)


def generated_here(path: str | os.PathLike) -> bool:
    """Whether this process generated the identity file at `path` (so no other peer can be running with it)."""
    return str(Path(path).expanduser()) in _GENERATED_HERE


def load_identity(path: str | os.PathLike) -> RSAPrivateKey:
    """The RSA private key of an identity file (hivemind's format: a libp2p PrivateKey protobuf)."""
    try:
        key = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if key.key_type != crypto_pb2.RSA:
            raise ValueError(f"key type {key.key_type} is not RSA")
        private = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind offers no loader; its own pickling path does this
        private.__setstate__({"_private_key": key.data})
    except (OSError, ValueError) as error:
        raise IdentityError(f"identity file {path} cannot be used ({error}); remove it to create a new one") from None
    return private


def peer_id_of(public_key: RSAPublicKey) -> PeerID:
    """The libp2p peer id of an RSA public key (sha2-256 multihash of its protobuf encoding)."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def peer_id_of_identity(path: str | os.PathLike) -> str:
    """The base58 peer id an identity file gives its node."""
    return peer_id_of(load_identity(path).get_public_key()).to_base58()

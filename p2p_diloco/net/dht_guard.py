"""What a p2p-diloco DHT node accepts: signed records that expire soon, and in a private swarm only members.

- `RSASignatureValidator` (hivemind's): a record whose subkey names an owner key can only be written by that key's
  holder. Islands announce under their own identity key, so nobody can overwrite another island's record.
- `BoundedExpiration`: no record may claim to live longer than MAX_EXPIRATION_S, so a forged record cannot
  outlive its writer for long.
- `MembershipAuthorizer` (private swarms): every DHT request and response carries the member's token and an RSA
  signature made with its identity key; hivemind's `TokenAuthorizerBase` checks freshness and replays, we check
  that the owner signed the token for the very peer id of that key.
"""

from __future__ import annotations

import json

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.net.identity import peer_id_of
from p2p_diloco.net.membership import Membership
from p2p_diloco.net.record_schema import MAX_EXPIRATION_S


class BoundedExpiration(RecordValidatorBase):
    """Refuses records that claim to expire more than MAX_EXPIRATION_S ahead."""

    def validate(self, record: DHTRecord) -> bool:
        """True for a record that expires soon enough."""
        return record.expiration_time <= get_dht_time() + MAX_EXPIRATION_S

    @property
    def priority(self) -> int:
        return 20  # cheap: checked before signatures


def record_validators(identity: RSAPrivateKey) -> list[RecordValidatorBase]:
    """The validators every p2p-diloco node runs."""
    return [RSASignatureValidator(identity), BoundedExpiration()]


class MembershipAuthorizer(TokenAuthorizerBase):
    """DHT requests of a private swarm: only from (and answered only by) holders of an owner-signed token."""

    def __init__(self, identity: RSAPrivateKey, membership: Membership):
        super().__init__(identity)
        self.membership = membership

    async def get_token(self) -> AccessToken:
        """Our token, with the identity key it was issued for."""
        expires = self.membership.expires(self.membership.token)
        return AccessToken(
            username=peer_id_of(self.local_public_key).to_base58(),
            public_key=self.local_public_key.to_bytes(),
            expiration_time=str(expires),
            signature=json.dumps(self.membership.token).encode(),
        )

    def is_token_valid(self, access_token: AccessToken) -> bool:
        """True when the owner signed the token for the peer id of the key that signs the request."""
        try:
            peer = peer_id_of(RSAPublicKey.from_bytes(access_token.public_key)).to_base58()
            document = json.loads(access_token.signature)
        except (ValueError, TypeError):
            return False
        return peer == access_token.username and self.membership.reason_to_refuse(document, peer) is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        """Tokens are issued offline: there is nothing to refresh."""
        return False

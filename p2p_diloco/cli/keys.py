"""`p2p-diloco keys`: a private swarm's owner key, membership tokens, revocations, and an island's peer id.

p2p-diloco keys new --out owner.key                       # prints the public key islands pass
p2p-diloco keys identity --identity island.key            # an island's peer id (the identity is created)
p2p-diloco keys invite --owner-key owner.key --identity island.key --expires 30d --out island.token
p2p-diloco keys revoke --owner-key owner.key --peer-id Qm... --out revoked.json
"""

from __future__ import annotations

import argparse
import json
import sys

from p2p_diloco.errors import UserError


def add_parser(commands: argparse._SubParsersAction) -> None:
    """The `keys` subcommand and its actions."""
    keys = commands.add_parser("keys", help="owner key, membership tokens and revocations of a private swarm")
    actions = keys.add_subparsers(dest="action", required=True)
    new = actions.add_parser("new", help="create an owner key and print its public key")
    new.add_argument("--out", required=True, help="file for the owner's private key (kept secret)")
    identity = actions.add_parser("identity", help="print the peer id of an island's --identity file")
    identity.add_argument("--identity", required=True, help="the island's identity file (created if missing)")
    invite = actions.add_parser("invite", help="issue a membership token for one peer")
    invite.add_argument("--owner-key", required=True, help="the owner's private key file")
    whom = invite.add_mutually_exclusive_group(required=True)
    whom.add_argument("--peer-id", help="the island's peer id (`keys identity` prints it)")
    whom.add_argument("--identity", help="the island's identity file (created if missing)")
    whom.add_argument("--peer-public-key", help="the island's RSA public key (ssh-rsa ...)")
    invite.add_argument("--run-id", help="only for this run (default: any run of this owner)")
    invite.add_argument("--expires", default="30d", help="validity, e.g. 30d, 12h, 90m (default 30d)")
    invite.add_argument("--out", required=True, help="the token file to give the island (--membership)")
    revoke = actions.add_parser("revoke", help="add peers to a signed revocation list (islands read --revoked)")
    revoke.add_argument("--owner-key", required=True, help="the owner's private key file")
    revoke.add_argument("--peer-id", required=True, nargs="+", help="peer ids to revoke")
    revoke.add_argument("--list", help="an earlier revocation list to extend")
    revoke.add_argument("--out", required=True, help="the revocation list to distribute (--revoked)")


def _peer_id(args: argparse.Namespace) -> str:
    from hivemind.p2p import PeerID
    from hivemind.utils.crypto import RSAPublicKey

    from p2p_diloco.net.identity import ensure_identity, peer_id_of, peer_id_of_identity

    if args.identity:  # created when missing: the owner may hand a new member its identity with its token
        return peer_id_of_identity(ensure_identity(args.identity))
    if args.peer_public_key:
        try:
            return peer_id_of(RSAPublicKey.from_bytes(args.peer_public_key.encode())).to_base58()
        except ValueError as error:
            raise UserError(f"--peer-public-key is not an RSA public key in ssh-rsa form ({error})") from None
    try:
        return PeerID.from_base58(args.peer_id).to_base58()
    except ValueError as error:
        raise UserError(f"--peer-id {args.peer_id!r} is not a peer id ({error})") from None


def run(args: argparse.Namespace) -> int:
    """Carry out one `keys` action."""
    from p2p_diloco.files import atomic_write
    from p2p_diloco.net import membership

    try:
        if args.action == "new":
            print(membership.new_owner_key(args.out))
        elif args.action == "identity":
            from p2p_diloco.net.identity import ensure_identity, peer_id_of_identity

            print(peer_id_of_identity(ensure_identity(args.identity)))
        elif args.action == "invite":
            owner = membership.load_owner_key(args.owner_key)
            token = membership.issue_token(owner, _peer_id(args), membership.parse_duration(args.expires), args.run_id)
            atomic_write(args.out, json.dumps(token, indent=1).encode())
            print(f"token for {token['token']['peer_id']} until {token['token']['expires']} written to {args.out}")
        else:
            owner = membership.load_owner_key(args.owner_key)
            previous = membership.read_json(args.list, "revocation list") if args.list else None
            revoked = membership.revocation_list(owner, args.peer_id, previous)
            atomic_write(args.out, json.dumps(revoked, indent=1).encode())
            print(f"{len(revoked['revoked']['peer_ids'])} revoked peers written to {args.out}")
    except UserError as error:
        print(f"p2p-diloco keys: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0

"""The `p2p-diloco` command and the launcher of local swarms."""

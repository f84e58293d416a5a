"""p2p-diloco: peer-to-peer Decoupled DiLoCo over a hivemind DHT."""

__version__ = "0.1.0"

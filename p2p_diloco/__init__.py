"""p2p-diloco: peer-to-peer Decoupled DiLoCo over a hivemind DHT.

The public API is `__all__`; everything is imported on first use, so `import p2p_diloco` stays cheap (hivemind
alone takes seconds to import). Layers, from the bottom: `diloco` (the math, pure torch), `train` (model, data,
checkpoints, metrics), `net` (hivemind: DHT, records, averaging, codecs), `island` (one island's loop), `cli`
(the command and the local-swarm launcher).
"""

from __future__ import annotations

import importlib
from typing import Any

from p2p_diloco.quick_start import defer_unused_imports

defer_unused_imports()  # before anything imports hivemind: see quick_start for why

__version__ = "0.1.0"

_EXPORTS = {
    # configuration and errors
    "PeerConfig": "p2p_diloco.config",
    "ModelConfig": "p2p_diloco.config",
    "DataConfig": "p2p_diloco.config",
    "TrainConfig": "p2p_diloco.config",
    "NetworkConfig": "p2p_diloco.config",
    "load_config": "p2p_diloco.config",
    "ConfigError": "p2p_diloco.config",
    "UserError": "p2p_diloco.errors",
    # the math
    "OuterOptimizer": "p2p_diloco.diloco.outer",
    "pseudo_gradient": "p2p_diloco.diloco.outer",
    "run_inner_steps": "p2p_diloco.diloco.inner",
    "make_inner_optimizer": "p2p_diloco.diloco.inner",
    "weighted_mean": "p2p_diloco.diloco.merge",
    "radial_directional_average": "p2p_diloco.diloco.merge",
    "contribution_weight": "p2p_diloco.diloco.merge",
    "StalenessRule": "p2p_diloco.diloco.staleness",
    "group_weights": "p2p_diloco.diloco.staleness",
    "GraceWindow": "p2p_diloco.diloco.grace",
    "Fragment": "p2p_diloco.diloco.fragments",
    "fragment_layout": "p2p_diloco.diloco.fragments",
    "ErrorFeedback": "p2p_diloco.diloco.error_feedback",
    "QUANTIZERS": "p2p_diloco.diloco.quantize",
    # training parts
    "build_model": "p2p_diloco.train.model",
    "load_shards": "p2p_diloco.train.data",
    "MetricsWriter": "p2p_diloco.train.metrics",
    "read_metrics": "p2p_diloco.train.metrics",
    # network
    "GossipExchange": "p2p_diloco.net.exchange",
    "ExchangeResult": "p2p_diloco.net.exchange",
    "CODECS": "p2p_diloco.net.codecs",
    # the island and the launcher
    "Island": "p2p_diloco.island.island",
    "LocalSwarm": "p2p_diloco.cli.launcher",
    "main": "p2p_diloco.cli.main",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'p2p_diloco' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

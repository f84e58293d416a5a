"""What a peer process skips or overlaps to start quickly, and the switch that turns it off for measuring.

Two shortcuts: (1) third-party modules imported on the way to hivemind whose code a p2p-diloco process never
runs are executed late (below); (2) `p2p-diloco peer` launches its DHT node before building the model, so that
p2pd starts and the initial peers are reached meanwhile (`p2p_diloco.island.link.begin_join`).
`P2P_DILOCO_PLAIN_START=1` turns both off: `benchmarks/restart.py` measures a restart both ways.

`hivemind.averaging.load_balancing` imports `scipy.optimize` at module level for `linprog`, which it calls only when
peers announce their bandwidths; p2p-diloco's averagers announce none, so every part split is uniform and linprog
never runs. The import still cost every process 0.3 s on an idle core (0.8 s beside four other islands), a
restarted island's start-up included. A finder at the front of `sys.meta_path` defers running such a module:
`import scipy.optimize` still works, and the module's code runs when something first looks up a name in it, so
code that does use it (a user's, a later hivemind's) gets the real module. Nothing is imported until someone
imports the module, so `import p2p_diloco` stays cheap.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

PLAIN_START_ENV = "P2P_DILOCO_PLAIN_START"
DEFERRED = frozenset({"scipy.optimize"})
_LOAD_LOCK = threading.RLock()  # a module's code runs once even if two threads reach for it together


class DeferredModule(types.ModuleType):
    """A module whose code has not run yet: what the import system set (`__name__`, `__file__`, `__spec__`, ...)
    reads as is; the first lookup of anything else runs the module and answers from it.

    The standard library's `LazyLoader` runs the module on *any* attribute access, and `inspect.getmodule`, which
    torch calls while registering its operators, reads `__file__` of every module in sys.modules: that alone
    would load it.
    """

    def __getattr__(self, name: str) -> Any:
        with _LOAD_LOCK:
            if isinstance(self, DeferredModule):  # not loaded by another thread meanwhile
                loader = self.__dict__.pop("__deferred_loader__")
                self.__class__ = types.ModuleType
                self.__loader__ = self.__spec__.loader = loader
                loader.exec_module(self)
        return getattr(self, name)


class DeferredLoader(importlib.abc.Loader):
    """Creates the module as its own loader would, and leaves running its code to `DeferredModule`."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        """The module object the real loader would create (None: the default)."""
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        """Defer running the module: remember the real loader on it."""
        module.__dict__["__deferred_loader__"] = self.loader
        module.__class__ = DeferredModule


class DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of `DEFERRED` with the finders behind it and defers running them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the other finders give `fullname`, its code deferred; None (ask the others) for other modules."""
        if fullname not in DEFERRED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = DeferredLoader(spec.loader)
                return spec
        return None


def plain_start() -> bool:
    """True when P2P_DILOCO_PLAIN_START=1 asks for a start without these shortcuts."""
    return os.environ.get(PLAIN_START_ENV) == "1"


def defer_unused_imports() -> None:
    """Install the deferring finder once (when p2p_diloco is imported); modules already imported stay as they are."""
    if plain_start():
        return
    if not any(isinstance(finder, DeferringFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeferringFinder())

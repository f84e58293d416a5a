"""hivemind's unused scipy.optimize import is deferred, and still works for whoever uses it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (imports are process-wide) and return its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_island_s_imports_and_optimizer_leave_scipy_optimize_unexecuted():
    out = run_fresh(
        """
        import sys
        import p2p_diloco
        assert "scipy" not in sys.modules, "importing p2p_diloco alone must not import scipy"
        import hivemind.averaging
        import torch
        # An optimizer step imports torch._dynamo, which reads __file__ of every module (inspect.getmodule).
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        print(type(sys.modules["scipy.optimize"]).__name__, sys.modules["scipy.optimize"].__file__.endswith(".py"))
        """
    )
    assert out == "DeferredModule True"


def test_a_deferred_module_executes_on_first_use():
    out = run_fresh(
        """
        import sys
        import p2p_diloco
        from hivemind.averaging.load_balancing import load_balance_peers
        # Announced bandwidths make hivemind call scipy.optimize.linprog: the lazy module must load for real.
        print(sum(load_balance_peers(1000, [1.0, 3.0])), type(sys.modules["scipy.optimize"]).__name__)
        """
    )
    assert out == "1000 module"


def test_a_peer_that_fails_after_launching_its_dht_node_leaves_no_process_behind(tmp_path, capsys):
    import contextlib

    import psutil

    from p2p_diloco.cli.main import main

    def running_children() -> dict[int, psutil.Process]:
        running = {}
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # one that exits while we look is not left behind
                if child.status() != psutil.STATUS_ZOMBIE:
                    running[child.pid] = child
        return running

    # Other tests in this process may have left their own helpers (torch's shm manager, wandb's service).
    before = running_children()
    missing = tmp_path / "no-such-corpus.txt"
    code = main(["peer", "--data", str(missing), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "early"])
    assert code == 2
    assert f"data.path {missing} does not exist" in capsys.readouterr().err
    # The DHT node (and its p2pd) was launched before the model and data: the failure must stop it.
    left = [child for pid, child in running_children().items() if pid not in before]
    assert not [c for c in left if c.name() != "torch_shm_manager"], [c.cmdline() for c in left]

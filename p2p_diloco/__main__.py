"""`python -m p2p_diloco`: the same as the `p2p-diloco` command."""

from p2p_diloco.cli.main import main

raise SystemExit(main())

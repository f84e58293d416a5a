from p2p_diloco.cli import main

raise SystemExit(main())

from p2p_diloco.cli.main import main

raise SystemExit(main())

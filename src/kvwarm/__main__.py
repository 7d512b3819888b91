from kvwarm.cli import main

raise SystemExit(main())

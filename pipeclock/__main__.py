from pipeclock.cli import main

raise SystemExit(main())

from pipeclock.app.cli import main

raise SystemExit(main())

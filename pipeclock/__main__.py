from pipeclock.cli.dispatch import main
from pipeclock.cli.interrupts import end_now, received

code = main()
if received() is not None:  # interrupted: end now, not in a teardown of communicators with work in flight
    end_now(code)
raise SystemExit(code)

import os
import sys

from pipeclock.app.cli import main
from pipeclock.app.interrupts import received

code = main()
if received() is not None:  # interrupted: end now, not in a teardown of communicators with work in flight
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)

import sys

from pipeclock.cli.dispatch import main
from pipeclock.cli.interrupts import end_now, received

code = main()
if received() is not None:  # interrupted: end now, not in a teardown of communicators with work in flight
    end_now(code)
blame = sys.modules.get("pipeclock.comm_blame")  # loaded with torch.distributed, by the commands that use it
if blame is not None and blame.end_at_once():  # stopped among peers: the line is out, end with its own code
    end_now(code)
raise SystemExit(code)

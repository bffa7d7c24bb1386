"""The command-line commands, one module each (see pipeclock.app.cli)."""

"""The command-line commands, one module each (see pipeclock.cli.dispatch)."""

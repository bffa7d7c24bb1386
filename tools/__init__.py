"""Course and maintainer tooling that needs the source checkout (docs pages, figures): not in the library."""

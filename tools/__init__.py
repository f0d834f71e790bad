"""Scripts the Makefile runs with the machine's own Python, before any venv exists."""

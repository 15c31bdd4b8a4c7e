"""The `nano` command line: `nano models`, `nano chat` (see cli/app.py)."""

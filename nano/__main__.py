"""`python -m nano ...`: the `nano` command, for when another `nano` (the GNU text editor) comes first on PATH.

An entry point only: no module of nano imports this file, and it is the one place under nano/ that reaches up
into the command line (nano.cli, installed from the cli/ folder)."""
from nano.cli.main import main

main()

"""`python -m fsdprun ...` = the `fsdprun` command."""

from fsdprun.cli import main

main()

"""`python -m fsdprun ...` = the `fsdprun` command.

Never imports anything but `fsdprun.cli`.
"""

from fsdprun.cli import main

main()

"""fsdprun: train LLMs with PyTorch FSDP from layered YAML recipes.

Run `fsdprun --help`, or see README.md.

Imports nothing: `fsdprun --help` and the read-only commands start without loading any package.
"""

__version__ = "0.1.0"

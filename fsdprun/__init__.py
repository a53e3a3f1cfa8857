"""fsdprun: train LLMs with PyTorch FSDP from layered YAML recipes.

Run `fsdprun --help`, or see README.md.
"""

__version__ = "0.1.0"

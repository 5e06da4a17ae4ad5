"""`python -m diloco.node` (and `torchrun -m diloco.node join ...`): the `diloco-node` command."""

from .cli import main

main()

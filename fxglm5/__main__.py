"""``python -m fxglm5``: the ``fxglm5`` command line (what ``torchrun -m fxglm5 generate --tp N`` runs per rank)."""

from fxglm5.cli import main

main()

"""``python -m fxglm5``: the ``fxglm5`` command line (what ``torchrun -m fxglm5 generate --tp N`` runs per rank).
Guarded: the ranks ``generate --tp`` spawns import this module again as ``__mp_main__``."""

from fxglm5.cli import main

if __name__ == "__main__":
    main()

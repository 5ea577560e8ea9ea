"""``python -m tokengym.agents.cli`` (what ``torchrun -m`` runs): the ``tokengym`` command."""

import sys

from tokengym.agents.cli.command import main

sys.exit(main())

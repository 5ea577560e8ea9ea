"""``python -m tokengym.agents.cli`` (what ``torchrun -m`` runs): the ``tokengym`` command."""

from tokengym.agents.cli.command import main
from tokengym.agents.runtime.distributed import exit_process

exit_process(main())  # (a torchrun rank skips the interpreter's teardown: see exit_process)

"""``python -m vexact``: the CLI; also what ``vexact run --nproc N`` and ``torchrun -m vexact run`` start per rank."""

import sys

from .cli import main

sys.exit(main())

"""Build (or find) the exact CPU kernels' compiled loops and print what the kernels will use.

    python -m vexact_kernels.build_loops                            # exit 1 if they did not build (mode auto)
    VEXACT_CPU_LOOPS=compiled python -m vexact_kernels.build_loops  # as CI runs it: a failed build is an error

(A module of its own: ``python -m vexact_kernels.compiled_loops`` would run a second copy of a module the package
has already imported.)
"""

import sys

from .compiled_loops import main

if __name__ == "__main__":
    sys.exit(main())

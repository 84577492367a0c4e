"""``python -m vexact.map build-map | sensitivity | shape``: the map's command line (``vexact.map.build``)."""

import sys

from .build import main

sys.exit(main())

"""``python -m qatlib.report EXP_DIR --out report.html``."""

import sys

from .build import main

sys.exit(main())

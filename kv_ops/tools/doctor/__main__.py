"""``python -m kv_ops.tools.doctor``: print the report, exit 1 if a check failed."""

import sys

from . import main

sys.exit(main())

"""`python -m services.gateway --model DIR ...`: the same as `twinspark serve-gateway`."""

import sys

from .cli import main

sys.exit(main())

"""`python -m services.launcher up|down ...`: the launcher's subcommands without the rest of the `twinspark` CLI
(whose other subcommands import torch). The detached supervisor is started this way."""

import sys

from .cli import main

sys.exit(main())

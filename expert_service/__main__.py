"""`python -m expert_service --checkpoint DIR --experts SPEC ...`: the same command as `moe-mesh serve-expert`."""

import sys

from expert_service.cli import main

sys.exit(main())

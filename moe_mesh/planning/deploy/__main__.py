"""`python -m moe_mesh.planning.deploy {deploy,probe} ...`."""

import sys

from moe_mesh.planning.deploy import main

sys.exit(main())

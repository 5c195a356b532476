"""`python -m moe_mesh.deploy {deploy,probe} ...`."""

import sys

from moe_mesh.deploy import main

sys.exit(main())

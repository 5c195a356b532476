import sys

from moe_mesh.cli import main

sys.exit(main())

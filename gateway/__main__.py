import sys

from moe_mesh.common import runtime

runtime.configure()  # before anything imports torch

from moe_mesh.gateway.cli import main  # noqa: E402

sys.exit(main())

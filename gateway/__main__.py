import sys

from common import runtime

runtime.configure()  # before anything imports torch

from gateway.cli import main  # noqa: E402

sys.exit(main())

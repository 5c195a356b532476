import sys

from router_service.cli import main

sys.exit(main())

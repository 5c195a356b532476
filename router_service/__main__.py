from common import runtime

runtime.configure()  # before anything imports torch
runtime.die_with_parent()

from router_service.cli import main  # noqa: E402

runtime.exit_now(main())

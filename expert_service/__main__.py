"""`python -m expert_service --checkpoint DIR --experts SPEC ...`: the same command as `moe-mesh serve-expert`."""

from common import runtime

runtime.configure()  # before anything imports torch
runtime.die_with_parent()

from expert_service.cli import main  # noqa: E402

runtime.exit_now(main())

"""Expert groups that scale themselves: `moe-mesh autoscale` and `up --autoscale`.

`policy.py` holds the bounds and behaviour of one group (a plan's `autoscale:` block) and the
decision itself, HPA's algorithm without I/O; `signals.py` turns the services' counters into a
load per replica; `actuators.py` changes replica counts (a local mesh, a compose project);
`controller.py` runs the loop and records every decision; `cli.py` is the command.
"""

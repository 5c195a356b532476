"""Running a mesh on this machine: `moe-mesh up` / `scale` (launcher and its embedded registry),
in-process generation, and the demo."""

from moe_mesh.cli import run

run()

"""Generate the Python protobuf/gRPC code (with .pyi stubs) for protos/moe_mesh/v1 into a directory.

`make protos` writes into the repository; tests/unit/moe_mesh/dev/test_protogen.py writes into a temp dir and diffs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = Path("protos/moe_mesh/v1")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under protos/moe_mesh/v1 into out_dir, mirroring the package path."""
    protos = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")
    generated = sorted((out_dir / PROTO_DIR).glob("*_pb2*.py*"))
    return generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)"
    )
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    sys.exit(main())

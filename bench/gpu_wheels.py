"""The Python 3.12 wheels a lent GPU machine lacks, downloaded into `.gpu-wheels/` (`make gpu-wheels`;
ignored by git, so a device run names it in `carry`) for `bench/gpu_check.py` to run there.

The GPU machine (the tool library's device KINDS.md: its CUDA image, read 2026-11-17) has torch 2.11
for CUDA 13, transformers, grpcio, uvloop, safetensors, tokenizers, httpx, prometheus-client and
more, and reaches no package registry. WHEELS names every runtime need of pyproject.toml's
dependencies (their transitive needs included) that the image lacks, plus a few it has at a
version our code refuses (CARRIED_ANYWAY); each is pinned to constraints.txt
(or, where it pins none, to the version installed in .venv). The working tree and the
carried wheels may be 64 MiB in all. UCX (`--ucx`: ucxx-cu13 and the libraries it loads, for
the image's CUDA 13 torch) is tried only on request and kept only if the whole still fits: its
libucx wheel alone is 42 MB, so with the rest it does not (measured in README.md's development
section), and the check then runs the mesh over gRPC.

    .venv/bin/python -m bench.gpu_wheels [--ucx] [--dir .gpu-wheels]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / ".gpu-wheels"
LIMIT_BYTES = 64 << 20  # the device tool's working-tree limit, wheels included
PYTHON = "3.12"
# pip matches a manylinux tag exactly: each wheel here has one of these (rapids' carry 2_24/2_27).
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
)  # fmt: skip

# The CUDA image's Python packages, as KINDS.md lists them (read there 2026-11-17).
DEVICE_HAS = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
    cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
    einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
    gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
    iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
    kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
    markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
    numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
    opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
    rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
# There, but at a version our code refuses or the parity reference differs at.
CARRIED_ANYWAY = {
    "grpcio": "protos/*_pb2_grpc.py refuse a grpcio older than the 1.85.1 that generated them",
    "protobuf": "protos/*_pb2.py refuse a runtime older than their gencode (7.35.1)",
    "transformers": "the parity reference is the pinned 5.23 (the image has 5.17); it needs "
    "huggingface-hub >= 1.31 and tokenizers 0.23, which the image has",
    "typing-extensions": "pydantic 2.14 needs >= 4.16, and the image's version was not read",
}
# Not runtime needs: what bench/gpu_check.py's part e runs the suite's CUDA tests with.
FOR_TESTS = {
    "pytest-asyncio": "the suite's async tests and its pytest settings; the image has pytest only",
}
# Every runtime need the image lacks (tests/unit/bench/test_gpu_wheels.py checks this against
# pyproject.toml's dependency closure), then CARRIED_ANYWAY and FOR_TESTS.
WHEELS = (
    "annotated-types", "cffi", "cryptography", "fastapi", "googleapis-common-protos",
    "grpcio-health-checking", "grpcio-reflection", "opentelemetry-api",
    "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-grpc", "opentelemetry-exporter-prometheus",
    "opentelemetry-instrumentation", "opentelemetry-instrumentation-grpc", "opentelemetry-proto",
    "opentelemetry-sdk", "opentelemetry-semantic-conventions", "py-consul", "pycparser",
    "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "starlette",
    "typing-inspection", "uvicorn", *CARRIED_ANYWAY, *FOR_TESTS,
)  # fmt: skip
# In the closure here, but not needs there: huggingface-hub 2's (httpx2 and what it needs; the
# image's hub 1.33 is what the carried transformers needs) and python-dateutil 4's (tzdata; the
# image has its own python-dateutil).
NOT_NEEDED = frozenset({"httpx2", "httpcore2", "truststore", "tzdata"})
# The UCX fast path for the image's CUDA 13 torch (pyproject's `fastpath-cu13` extra) and what
# its metadata needs that the image lacks (cuda-core, cuda-bindings, nvidia-ml-py are there).
UCX = ("ucxx-cu13", "libucxx-cu13", "libucx-cu13", "rmm-cu13", "librmm-cu13", "rapids-logger")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """name -> version of every `name==version` line of constraints.txt."""
    out = {}
    for line in constraints.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            out[normalize(name)] = version.strip()
    return out


def version(name: str, pinned: dict[str, str]) -> str | None:
    """constraints.txt's version of `name`, else the one installed here (.venv: a need that
    constraints.txt leaves to the resolver, such as pydantic-core), else None."""
    if (v := pinned.get(normalize(name))) is not None:
        return v
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def requirements(names: tuple[str, ...], pinned: dict[str, str]) -> list[str]:
    """`name==version` for each of `names`; KeyError naming those with no version (see version)."""
    versions = {n: version(n, pinned) for n in names}
    if unpinned := [n for n, v in versions.items() if v is None]:
        raise KeyError(f"neither constraints.txt nor this environment has {', '.join(unpinned)}")
    return [f"{n}=={v}" for n, v in versions.items()]


def wheel_name(path: Path) -> str:
    """The normalized distribution name of a wheel file (`pydantic_core-2.50.4-cp312-...`)."""
    return normalize(path.name.split("-")[0])


def present(folder: Path) -> dict[str, Path]:
    """name -> wheel of every wheel in `folder` (none if it is absent)."""
    return {wheel_name(p): p for p in sorted(folder.glob("*.whl"))} if folder.is_dir() else {}


def missing(folder: Path, names: tuple[str, ...] = WHEELS) -> list[str]:
    """Those of `names` with no wheel in `folder`."""
    have = present(folder)
    return [n for n in names if normalize(n) not in have]


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels without carry: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    files = (root / p.decode() for p in listed if p)
    return sum(f.stat().st_size for f in files if f.is_file())


def download(reqs: list[str], folder: Path) -> None:
    """pip download of exactly `reqs`: CPython 3.12 manylinux x86_64 wheels, no dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", PYTHON, "--implementation", "cp", "--dest", str(folder)]
    cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*cmd, *reqs], check=True)


def check_wheels(folder: Path) -> list[str]:
    """Problems with the folder's wheels: two versions of one name stop the whole install there,
    and a file that is not a zip is a failed download."""
    seen: dict[str, str] = {}
    problems = []
    for p in sorted(folder.glob("*.whl")):
        if (name := wheel_name(p)) in seen:
            problems.append(f"two wheels of {name}: {seen[name]} and {p.name}")
        seen[name] = p.name
        if not zipfile.is_zipfile(p):
            problems.append(f"{p.name} is not a wheel (zip)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=FOLDER, help="where the wheels go")
    parser.add_argument("--ucx", action="store_true", help="try the UCX wheels too (kept if fit)")
    args = parser.parse_args(argv)
    pinned = pins()
    args.dir.mkdir(parents=True, exist_ok=True)
    have = present(args.dir)
    for stale in set(have) - {normalize(n) for n in (*WHEELS, *UCX)}:
        have[stale].unlink()  # a name the list dropped: it would travel for nothing
    download(requirements(WHEELS, pinned), args.dir)
    base = sum(p.stat().st_size for p in present(args.dir).values() if wheel_name(p) not in UCX)
    tree = tree_bytes()
    print(f"wheels: {base / 2**20:.1f} MiB in {args.dir}; the working tree {tree / 2**20:.1f} MiB")
    if args.ucx:
        download(requirements(UCX, pinned), args.dir)
    ucx = [p for p in present(args.dir).values() if wheel_name(p) in UCX]
    ucx_bytes = sum(p.stat().st_size for p in ucx)
    if ucx and base + ucx_bytes + tree > LIMIT_BYTES:
        print(f"UCX wheels: {ucx_bytes / 2**20:.1f} MiB more, {(base + ucx_bytes + tree) / 2**20:.1f}"
              f" MiB in all, over the 64 MiB limit: left out (the check runs the mesh over gRPC)")  # fmt: skip
        for p in ucx:
            p.unlink()
    elif ucx:
        print(f"UCX wheels: {ucx_bytes / 2**20:.1f} MiB more: they fit, and travel")
    if problems := check_wheels(args.dir) + [f"no wheel of {n}" for n in missing(args.dir)]:
        print("\n".join(problems), file=sys.stderr)
        return 1
    total = sum(p.stat().st_size for p in present(args.dir).values())
    print(f"total: {len(present(args.dir))} wheels, {total / 2**20:.1f} MiB; "
          f"with the working tree {(total + tree) / 2**20:.1f} of 64 MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

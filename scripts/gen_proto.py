"""Generate the Python stubs of the control plane from ``proto/`` (never edit them by hand).

    python scripts/gen_proto.py           # write kvstore/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python scripts/gen_proto.py --check   # exit 1 if the committed stubs are not up to date

Stubs are generated with ``grpc_tools.protoc -I proto``, so ``proto/kvstore/v1/x.proto``
becomes the module ``kvstore.v1.x_pb2`` and imports read ``from kvstore.v1 import x_pb2``.
The output depends only on the .proto files and the grpcio-tools version (both the
protobuf and the grpc stubs embed the generator's version): files are passed in sorted,
relative order, line endings are normalised and a fixed ``__init__.py`` is written.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["check", "generate", "main"]

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = Path("kvstore") / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
INIT_TEXT = '"""Generated control-plane stubs (``scripts/gen_proto.py``); do not edit."""\n'


def _protos() -> list[Path]:
    """The .proto files of the package, relative to ``proto/``, in sorted order."""
    found = sorted(p.relative_to(PROTO_DIR) for p in (PROTO_DIR / PACKAGE).glob("*.proto"))
    if not found:
        raise SystemExit(f"gen_proto: no .proto files under {PROTO_DIR / PACKAGE}")
    return found


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under ``out_root/kvstore/v1``; return their paths relative to out_root.

    Blocks while protoc runs. Raises ``SystemExit`` if protoc fails.
    """
    from grpc_tools import protoc  # dev dependency; imported only when generating

    include = Path(protoc.__file__).resolve().parent / "_proto"
    protos = _protos()
    (out_root / PACKAGE).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(PROTO_DIR / p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("gen_proto: protoc failed (see the message above)")
    (out_root / PACKAGE / "__init__.py").write_text(INIT_TEXT)
    written = [PACKAGE / "__init__.py"]
    for proto in protos:
        stem = proto.with_suffix("").name
        for suffix in SUFFIXES:
            path = PACKAGE / f"{stem}{suffix}"
            _normalise(out_root / path)
            written.append(path)
    return written


def _normalise(path: Path) -> None:
    """Unix line endings and exactly one trailing newline, whatever the platform."""
    text = path.read_text().replace("\r\n", "\n")
    path.write_text(text.rstrip("\n") + "\n")


def _stub_files(root: Path) -> set[Path]:
    """Generated-looking files present under ``root/kvstore/v1``, relative to root."""
    pkg = root / PACKAGE
    if not pkg.is_dir():
        return set()
    names = {p for p in pkg.iterdir() if p.is_file() and p.name.endswith(SUFFIXES)}
    return {p.relative_to(root) for p in names} | (
        {PACKAGE / "__init__.py"} if (pkg / "__init__.py").exists() else set()
    )


def check() -> int:
    """Regenerate into a temporary directory and compare; return 0 if the stubs are current."""
    with tempfile.TemporaryDirectory(prefix="kvstore-proto-") as tmp:
        fresh_root = Path(tmp)
        fresh = set(generate(fresh_root))
        committed = _stub_files(ROOT)
        stale = sorted(
            str(p)
            for p in fresh
            if not (ROOT / p).exists() or not filecmp.cmp(fresh_root / p, ROOT / p, shallow=False)
        )
        extra = sorted(str(p) for p in committed - fresh)
    if stale or extra:
        for path in stale:
            print(f"gen_proto: {path} is missing or differs from proto/", file=sys.stderr)
        for path in extra:
            print(f"gen_proto: {path} has no .proto source", file=sys.stderr)
        print(
            "gen_proto: stubs are out of date; run `python scripts/gen_proto.py` and commit "
            f"(grpcio-tools {_tools_version()})",
            file=sys.stderr,
        )
        return 1
    print("gen_proto: stubs are up to date")
    return 0


def _tools_version() -> str:
    """Installed grpcio-tools version (the stubs embed it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpcio-tools")
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> int:
    """Entry point: generate in place, or ``--check``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs differ")
    args = parser.parse_args(argv)
    if args.check:
        return check()
    with tempfile.TemporaryDirectory(prefix="kvstore-proto-") as tmp:
        written = generate(Path(tmp))
        for path in _stub_files(ROOT) - set(written):
            (ROOT / path).unlink()
        for path in written:
            (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / path, ROOT / path)
            print(f"gen_proto: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

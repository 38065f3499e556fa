"""The README tells the truth: its Python snippet runs as shown, verbatim, against a real
``kvstore serve``; its quick start is two commands; it lists every kvctl command; the docs
name nothing outside the repository; and ``make test``'s pytest step
(scripts/pytest_redis.py) brings a throwaway Redis, or says how many tests it skipped."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import start_server

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_snippet() -> str:
    """The one ```python block of README.md, exactly as written."""
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)
    assert len(blocks) == 1, f"README.md has {len(blocks)} python blocks, expected one"
    return blocks[0]


def test_readme_snippet_runs_as_shown(tmp_path: Path) -> None:
    snippet = readme_snippet()
    assert "asyncio.run(main())" in snippet and 'os.environ.get("KVSTORE_MASTER"' in snippet
    script = tmp_path / "readme_snippet.py"
    script.write_text(snippet)
    server = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port",
                          "0", "--host-mem", "256MiB")  # fmt: skip
    try:
        env = dict(os.environ, KVSTORE_MASTER=server.grpc)
        out = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    finally:
        rc, log = server.stop()
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "stored 768 tokens a layer, cached 768, layer 0 (2, 768, 8, 128)",
        "streamed 32 layers",
    ], out.stdout + out.stderr
    assert rc == 0 and "pinned_slots=0" in log, log


def test_readme_quick_start_is_two_commands() -> None:
    text = README.read_text()
    quick = text[text.index("## Quick start") : text.index("## Use it")]
    [block] = re.findall(r"^```sh\n(.*?)^```$", quick, re.M | re.S)
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make demo", "make test"]


def test_readme_lists_every_kvctl_command() -> None:
    import io

    from kvctl.main import build_parser

    parser = build_parser(io.StringIO(), io.StringIO())
    [subs] = [a for a in parser._actions if a.choices and a.dest == "command"]
    [line] = [ln for ln in README.read_text().splitlines() if "kvctl status |" in ln]
    listed = set(re.findall(r"[a-z]+", line.split("#")[0]))
    assert set(subs.choices) <= listed, set(subs.choices) - listed


def test_docs_refer_to_nothing_outside_the_repository() -> None:
    root = README.parent
    pages = [README, root / "bench" / "RESULTS.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert "DESIGN.md" not in text and "../shared" not in text, page
        for ref in re.findall(r"`((?:docs|bench|deploy|scripts|examples)/[\w./-]+)`", text):
            assert (root / ref).exists(), f"{page.name} names {ref}, which does not exist"


def test_no_file_refers_to_anything_outside_the_repository() -> None:
    """Code, docstrings, the proto and the deploy files point inside the repository too."""
    root = README.parent
    skip = {".venv", ".venv-vllm", ".git", "build", "node_modules", "__pycache__"}
    this = {Path(__file__).name, "test_deploy.py"}  # (they spell out what they look for)
    kinds = {".py", ".md", ".proto", ".toml", ".yaml", ".yml", ".json", ".cfg", ".txt"}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or rel.parts[0].endswith(".egg-info") or path.name in this:
            continue
        if path.is_file() and (path.suffix in kinds or path.name in ("Makefile", "run")):
            text = path.read_text(errors="replace")
            assert "DESIGN.md" not in text and "../shared" not in text, rel


_REDIS_PROBE = """
import os
import socket

import pytest

URL = os.environ.get("KVSTORE_TEST_REDIS", "")


@pytest.mark.skipif(not URL, reason="KVSTORE_TEST_REDIS unset")
@pytest.mark.parametrize("i", [0, 1])
def test_ping(i):
    host, port = URL.removeprefix("redis://").split("/")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"PING\\r\\n")
        assert s.recv(64).startswith(b"+PONG")
"""


def _pytest_redis(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``make test``'s pytest step (scripts/pytest_redis.py) on a two-test Redis probe."""
    (tmp_path / "test_probe.py").write_text(_REDIS_PROBE)
    script = README.parent / "scripts" / "pytest_redis.py"
    return subprocess.run(
        [sys.executable, str(script), "-q", "-p", "no:cacheprovider", "test_probe.py"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server installed")
def test_make_test_starts_and_stops_a_throwaway_redis(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_TEST_REDIS"}
    out = _pytest_redis(tmp_path, env)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout + out.stderr
    match = re.search(r"throwaway redis-server at redis://127\.0\.0\.1:(\d+)/0", out.stdout)
    assert match, out.stdout
    with pytest.raises(OSError):  # stopped afterwards
        socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=2).close()


def test_make_test_says_how_many_redis_tests_it_skipped(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_TEST_REDIS"}
    out = _pytest_redis(tmp_path, {**env, "PATH": str(tmp_path / "no-redis-here")})
    assert out.returncode == 0 and "2 skipped" in out.stdout, out.stdout + out.stderr
    assert "2 Redis tests were SKIPPED" in out.stderr, out.stderr


def test_architecture_names_every_setting_and_metric() -> None:
    """docs/architecture.md's tables keep up with kvstore/config.py and kvstore/metrics.py."""
    from kvstore.config import SETTINGS

    root = README.parent
    page = (root / "docs" / "architecture.md").read_text()
    for s in SETTINGS:
        assert f"| `{s.name}` |" in page, s.name
    declared = set(re.findall(r'"(kvstore_\w+)"', (root / "kvstore" / "metrics.py").read_text()))
    collected = re.findall(r'"(kvstore_prefix_\w+)"', (root / "kvstore" / "cli.py").read_text())
    declared |= {f"{name}_total" for name in collected}  # cli.py's collector (counters)
    assert len(collected) == 3, collected
    assert len(declared) >= 9
    for name in declared:
        assert f"| `{name}` |" in page, name

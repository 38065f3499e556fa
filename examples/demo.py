"""The quick-start demo: start ``kvstore serve``, stream a prompt's KV from a prefill
process to a decode process, show ``kvctl status``, stop the server.

    python examples/demo.py
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def main() -> int:
    server = subprocess.Popen(
        [str(BIN / "kvstore"), "serve", "--grpc-port", "0", "--data-port", "0",
         "--metrics-port", "0", "--host-mem", "512MiB"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None
    try:
        line = server.stdout.readline()
        if "kvstore ready" not in line:
            print("kvstore serve did not start", file=sys.stderr)
            return 1
        print(line.strip())
        master = re.search(r"grpc=(\S+)", line).group(1)  # type: ignore[union-attr]
        decode = subprocess.Popen([sys.executable, str(HERE / "decode.py"), master])
        time.sleep(1.0)
        subprocess.run([sys.executable, str(HERE / "prefill.py"), master], check=True)
        if decode.wait(timeout=120) != 0:
            return 1
        subprocess.run([str(BIN / "kvctl"), "--master", master, "status"], check=True)
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=30)
        print(rest.strip())
    return server.returncode


if __name__ == "__main__":
    sys.exit(main())

"""Start a server, wait for it to say it is ready, send one greedy generate over HTTP, and print
how long it took to be ready and each process's peak RSS (the kernel's VmHWM: exact, whatever
else the machine runs), then stop it. Every argument goes to launch.py.

    python benchmarks/serve_memory.py --model /work/models/qwen3-8b [--quantization int8]

The server's log goes to serve_memory.log in the current directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
HTTP_PORT, ZMQ_PORT = 30821, 30121
READY_LINE = "radixserve ready"
LOG = Path("serve_memory.log")


def process_tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pids
    for child in children:
        pids += process_tree(int(child))
    return pids


def status_field(pid: int, field: str) -> int:
    """A size field of /proc/PID/status (VmHWM, VmRSS) in bytes; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def main() -> None:
    ports = ["--port", str(ZMQ_PORT), "--http-port", str(HTTP_PORT)]
    start = time.monotonic()
    with LOG.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, str(LAUNCH), *ports, *sys.argv[1:]], stdout=log, stderr=log
        )
    try:
        while READY_LINE not in LOG.read_text():
            if server.poll() is not None:
                sys.exit(f"the server exited with {server.returncode}: see {LOG}")
            time.sleep(0.5)
        ready_s = time.monotonic() - start
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
        body["sampling_params"]["temperature"] = 0
        request = urllib.request.Request(
            f"http://127.0.0.1:{HTTP_PORT}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        print(f"ready after {ready_s:.1f} s; one generate: {answer['output_ids']}")
        print("peak RSS of each process (VmHWM):")
        for pid in process_tree(server.pid):
            print(f"  {status_field(pid, 'VmHWM') / 1e9:6.2f} GB  {pid} {process_name(pid)}")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()

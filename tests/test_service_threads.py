"""A service process runs its BLAS on one thread (`protocol.http_server.one_blas_thread`):
OpenBLAS's idle threads busy-wait after each call, and a scheduler refitting its
Predictors' step models a few times a second spent two thirds of its CPU there."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx

SERVICE = textwrap.dedent("""
    import json, sys
    import numpy  # noqa: F401  (loads OpenBLAS, as every service does)
    from fastapi import FastAPI
    from threadpoolctl import threadpool_info
    from rps_astro_cli.protocol.http_server import serve_blocking

    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    print("before: " + json.dumps(blas_threads()), flush=True)
    app = FastAPI()
    app.get("/blas")(blas_threads)
    app.get("/frozen")(lambda: __import__("gc").get_freeze_count())
    print("frozen before: " + json.dumps(__import__("gc").get_freeze_count()), flush=True)
    serve_blocking(app, "127.0.0.1", 0, ready_file=sys.argv[1])
""")


def test_a_served_app_runs_blas_on_one_thread_and_freezes_its_startup(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, str(ready)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        before = json.loads(proc.stdout.readline().removeprefix("before: "))
        assert before, "numpy's BLAS is not visible to threadpoolctl"
        frozen_before = json.loads(proc.stdout.readline().removeprefix("frozen before: "))
        url = proc.stdout.readline().strip().removeprefix("ready: ")
        assert url.startswith("http://127.0.0.1:"), url
        assert httpx.get(url + "/blas", timeout=10).json() == [1] * len(before)
        # what starting made is out of the garbage collector's scans once ready (gc.freeze):
        # thousands of objects (numpy, FastAPI, the app), none frozen before
        assert frozen_before == 0
        assert httpx.get(url + "/frozen", timeout=10).json() > 10_000
    finally:
        proc.terminate()
        proc.wait(30)

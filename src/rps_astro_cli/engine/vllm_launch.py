"""Start a real vLLM OpenAI server with astro's scheduler plugin and `/status`.

`launch_vllm_engine(...)` runs, in a child process (its own session, so `stop()` ends the
API server and its engine-core/worker children together):

    PYTHON -m vllm.entrypoints.openai.api_server --model MODEL --host H --port P
        --scheduler-cls rps_astro_cli.engine.vllm_plugin.astro_scheduler
        --middleware rps_astro_cli.engine.vllm_bridge.status_middleware
        --enable-server-load-tracking [extra vLLM flags...]

with the policy, instance id and a private status-socket path in the environment
(`vllm_bridge`). vLLM itself then serves `/v1/*`, `/health` and `/metrics`, and the
middleware serves `/status` (the `status.InstanceStatus` schema) from the engine core:
the same surface as an astro sim engine, so the Predictor, scheduler and bench treat both
alike. `python -m ...` is used because the `vllm` console command fails on the CPU
wheel's missing package metadata.

PYTHON is `python=`, else `$ASTRO_VLLM_PYTHON`, else this interpreter: vLLM can live in
its own virtual environment as long as `rps_astro_cli` is installed there too.
`VLLM_CPU_OMP_THREADS_BIND` defaults to `nobind` (several CPU instances on few cores).

This module does not import vllm; `vllm_plugin` does, inside the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rps_astro_cli.engine.vllm_bridge import (
    ENV_INSTANCE_ID,
    ENV_POLICY,
    ENV_POLICY_PARAMS,
    ENV_PROFILE_ID,
    ENV_STATUS_SOCKET,
    policy_from_env,
)
from rps_astro_cli.errors import AstroUserError

SCHEDULER_CLS = "rps_astro_cli.engine.vllm_plugin.astro_scheduler"
STATUS_MIDDLEWARE = "rps_astro_cli.engine.vllm_bridge.status_middleware"
ENV_PYTHON = "ASTRO_VLLM_PYTHON"
# Flags astro sets itself; passing them through would fight the plugin / launcher.
_RESERVED = ("--host", "--port", "--scheduler-cls", "--scheduling-policy", "--model")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _flag_present(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def vllm_python(python: str | None = None) -> str:
    """The interpreter that runs vLLM (see module docstring).

    Raises:
        AstroUserError: the chosen interpreter does not exist, or (for this interpreter)
            vllm is not importable.
    """
    exe = python or os.environ.get(ENV_PYTHON) or sys.executable
    if not (Path(exe).exists() or shutil.which(exe)):
        raise AstroUserError(f"python interpreter {exe!r} not found", field=ENV_PYTHON,
                             fix="point it at the python of the venv where vllm is installed")
    if exe == sys.executable:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise AstroUserError("vllm is not installed in this environment", field="--backend",
                                 fix=f"pip install 'rps_astro_cli[vllm]', or set {ENV_PYTHON} "
                                     "to a python that has vllm and rps_astro_cli")
    return exe


@dataclass
class VllmEngine:
    """A running vLLM server started by `launch_vllm_engine`.

    base_url: `http://HOST:PORT` (no trailing slash). status_socket: the engine core's
    status socket. log_path: the server's combined stdout/stderr.
    """

    proc: subprocess.Popen
    base_url: str
    status_socket: str
    log_path: str
    cmd: list[str] = field(default_factory=list)
    _tmpdir: str | None = None

    def log_tail(self, n_chars: int = 3000) -> str:
        if self.log_path == "-":
            return "(the server's output is above)"
        try:
            return Path(self.log_path).read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 0.5) -> float:
        """Block until `/health` and `/status` both answer 200; returns seconds waited.

        Raises:
            RuntimeError: the server exited (its log tail is in the message) or was not
                ready within `timeout_s`.
        """
        import httpx

        from rps_astro_cli.protocol.internal_auth import internal_token, token_headers

        headers = token_headers(internal_token())  # the server inherits our environment, token included
        t0 = time.monotonic()
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(f"vLLM server exited with code {rc} before it was ready; "
                                   f"log tail:\n{self.log_tail()}")
            try:
                with httpx.Client(timeout=2.0, headers=headers) as c:
                    if (c.get(self.base_url + "/health").status_code == 200
                            and c.get(self.base_url + "/status").status_code == 200):
                        return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"vLLM server not ready after {timeout_s:.0f} s; log tail:\n"
                                   f"{self.log_tail()}")
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL after `timeout_s`; returns the exit
        code (None if it could not be reaped)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    return None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        return self.proc.returncode


def launch_vllm_engine(
    model: str,
    host: str = "127.0.0.1",
    port: int = 0,
    policy: str = "fcfs",
    extra_args: Sequence[str] = (),
    *,
    policy_params: dict[str, Any] | None = None,
    instance_id: str = "vllm-0",
    profile_id: str = "",
    python: str | None = None,
    env: dict[str, str] | None = None,
    log_path: str | None = None,
) -> VllmEngine:
    """Start vLLM's OpenAI server for `model` with astro's plugin (does not wait: call
    `wait_ready()`).

    model: a local folder or a model name vLLM can resolve. port 0: a free port is picked.
    policy / policy_params: astro instance policy (checked here against the registry,
    after importing the modules in `ASTRO_VLLM_POLICY_MODULES`, if any).
    extra_args: vLLM flags passed through (e.g. `--max-model-len 512`,
    `--kv-cache-memory-bytes 8000000`). env: extra environment for the server.
    log_path: where the server's output goes (default: a file in a private temp dir;
    "-" = this process's stdout/stderr).

    Raises:
        AstroUserError: unknown policy, a reserved flag in `extra_args` (--host, --port,
            --model, --scheduler-cls, --scheduling-policy), or no usable vllm interpreter.
    """
    for flag in _RESERVED:
        if _flag_present(extra_args, flag):
            raise AstroUserError(f"{flag} is set by astro; remove it from the vLLM arguments",
                                 field=flag, fix="use astro's own option for it")
    exe = vllm_python(python)
    if port == 0:
        port = free_port(host)
    tmpdir = tempfile.mkdtemp(prefix="astro-vllm-")
    sock = os.path.join(tmpdir, "status.sock")
    log = log_path or os.path.join(tmpdir, "server.log")
    cmd = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", host, "--port", str(port), "--scheduler-cls", SCHEDULER_CLS,
           "--middleware", STATUS_MIDDLEWARE]
    if not _flag_present(extra_args, "--enable-server-load-tracking"):
        cmd.append("--enable-server-load-tracking")
    cmd += list(extra_args)
    penv = dict(os.environ)
    penv.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    penv.update(env or {})
    penv[ENV_POLICY] = policy
    penv[ENV_POLICY_PARAMS] = json.dumps(policy_params or {})
    penv[ENV_STATUS_SOCKET] = sock
    penv[ENV_INSTANCE_ID] = instance_id
    penv[ENV_PROFILE_ID] = profile_id
    policy_from_env(penv)  # fail fast on a bad name/params (and load ASTRO_VLLM_POLICY_MODULES)
    if log == "-":
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=penv, start_new_session=True)
    else:
        fh = open(log, "ab")
        try:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=penv, start_new_session=True)
        finally:
            fh.close()
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return VllmEngine(proc=proc, base_url=f"http://{url_host}:{port}", status_socket=sock,
                      log_path=log, cmd=cmd, _tmpdir=tmpdir)

"""The process supervisor behind `astro serve` (no role): a whole cluster on one machine.

`ClusterSupervisor(cfg).start()` launches, as child processes of this one,
N engines (`astro serve engine`), N Predictors (one per engine), the tagger and the
scheduler (the fleet as `services.config.instance_specs` expands the recipe: each engine
runs its own profile and limits, each Predictor is told its `assumed_profile`, by
default its engine's), each on a free port the OS picks (`--port 0 --ready-file F`: the child writes
its URL once listening). Order: engines + tagger, then predictors, then the scheduler;
each phase waits until every child answers `GET /health`. Internal services bind
127.0.0.1; only the scheduler binds `cfg.host`. Logs go to `<run_dir>/<child>.log`.
Every child gets this cluster's internal token (a fresh random one, in its environment
as $ASTRO_INTERNAL_TOKEN; also `<run_dir>/internal-token`, mode 0600): engines,
Predictors and the tagger refuse callers without it on every route but /health and
/ready, and the scheduler and Predictors send it (`protocol.internal_auth`).

Before launching anything, `start()` refuses (one line naming the file and the fix) when
the cluster.json it would write names a live astro process (another `astro serve` in the
same folder), and when the scheduler's fixed `--port` is taken (naming the port).

`supervise()` then watches the children: a child that exits is reported (name, pid, exit
code, log path and its last lines) and restarted on the same port, at most
`cfg.restart_crashed` times within `RESTART_WINDOW_S` (60 s) per child — older restarts
are forgiven, so a child that crashes now and then over a long run keeps being restarted,
while one that crash-loops is given up on; the scheduler's health checks take the
instance out and readmit it. cluster.json is rewritten after each restart or give-up, so
its pids are the live children's. SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after a grace period).
Children run in their own sessions so a terminal's Ctrl-C reaches them only through us,
and (on Linux) get SIGTERM if the supervisor itself dies, so no orphan outlives it.

`cluster.json` — what `astro bench` (live mode) and scripts read (schema "astro.cluster/1"):

    {"schema": "astro.cluster/1",
     "name": str,                       # recipe name
     "created_unix_s": float,
     "scheduler": {"url": str,          # http://HOST:PORT
                   "openai_base_url": str,   # url + "/v1" (OpenAI clients' base_url)
                   "metrics_url": str, "decisions_url": str, "pid": int},
     "tagger": {"url": str, "pid": int} | null,
     "instances": [{"name": "engine-0", "engine_url": str, "status_url": str,
                    "metrics_url": str, "predictor_url": str | null,
                    "predictor_metrics_url": str | null,
                    "engine_pid": int, "predictor_pid": int | null,
                    "profile": str,             # the execution profile this engine runs
                    "assumed_profile": str | null,  # the one its Predictor simulates (null: no Predictor)
                    "time_scale": float}, ...],
     "policy": {"name": str, ...params},     # e.g. {"name": "power_of_k", "k": 2, "objective": "e2e"}
     "profile": str,                    # engine-0's execution profile id/path (every engine's
                                        # when the fleet is homogeneous; per engine: "instances")
     "model": str | null,               # served model name (from the engines' /v1/models)
     "time_scale": float,               # wall s per engine s (the engines' common one, else
                                        # engine.time_scale)
     "instance_policy": str,            # in-instance policy of every engine
     "api_key_required": bool,          # the key itself is never written
     "internal_token_file": str | null, # the internal token's file (mode 0600; engines,
                                        # Predictors and the tagger need it, protocol.internal_auth)
     "log_dir": str,
     "recipe": {...}}                   # the validated recipe (api_key removed)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rps_astro_cli.services.config import ClusterConfig, instance_specs

CLUSTER_SCHEMA = "astro.cluster/1"
START_TIMEOUT_S = 60.0
REAL_ENGINE_START_TIMEOUT_S = 900.0  # vLLM loads weights / compiles: minutes, not seconds
STOP_GRACE_S = 5.0
RESTART_WINDOW_S = 60.0  # the restart budget counts a child's restarts within this window (s)


def _load_prctl() -> Any:
    """libc's prctl, looked up once here in the parent: the child must not import or dlopen
    between fork and exec (a multi-threaded parent can hold those locks at fork time)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


_PRCTL = _load_prctl()


def die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the supervisor dies, so a
    killed `astro serve` never leaves orphans (no-op elsewhere)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt


class ClusterError(RuntimeError):
    """A child failed to start or the cluster cannot go on."""


@dataclass
class Child:
    """One supervised process. argv excludes `--port/--ready-file` (added per start)."""

    name: str
    role: str
    argv: list[str]
    host: str
    log_path: Path
    ready_path: Path
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    url: str | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0  # restarts over the cluster's life
    restart_times: list[float] = field(default_factory=list)  # monotonic s of the restarts in the window
    started_at: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def launch(self) -> None:
        """Start (or restart, on the same port once known) the process."""
        self.ready_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", self.role, *self.argv,
               "--host", self.host, "--port", str(self.port), "--ready-file", str(self.ready_path)]
        log = open(self.log_path, "ab")
        log.write(f"\n--- start {time.strftime('%H:%M:%S')}: {' '.join(cmd)}\n".encode())
        log.flush()
        # keys only where asked: the front-door key to the scheduler, this cluster's own
        # internal token (never one inherited from the caller) to every child
        env = {k: v for k, v in os.environ.items()
               if k not in ("ASTRO_API_KEY", "ASTRO_INTERNAL_TOKEN", "ASTRO_INTERNAL_TOKEN_FILE")}
        env.update(self.env)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class ClusterSupervisor:
    """Start, watch and stop a cluster (see module docstring).

    cfg: the validated recipe. run_dir: logs and ready files. cluster_json: where to
    write the endpoints (None = only `<run_dir>/cluster.json`). report: called with one
    line per event (crash, restart, stop); the CLI prints them. restart_window_s: each
    child gets at most `cfg.restart_crashed` restarts within this many seconds.
    """

    def __init__(self, cfg: ClusterConfig, run_dir: str | Path, cluster_json: str | Path | None = None,
                 report: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
                 restart_window_s: float = RESTART_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.specs = instance_specs(cfg)  # per engine: its profile, engine settings, the Predictor's profile
        scales = {spec.engine.time_scale for spec in self.specs}
        # wall s per engine s of the fleet: the scheduler and `astro bench` convert observed times by it
        self.time_scale: float = scales.pop() if len(scales) == 1 else cfg.engine.time_scale
        self.restart_window_s = restart_window_s  # the restart budget's window (s)
        self.clock = clock  # monotonic seconds (a test's fake clock)
        self.created_unix_s: float | None = None  # when cluster.json was first written
        self.run_dir = Path(run_dir)
        self.cluster_json = Path(cluster_json) if cluster_json else None
        self.report = report
        self.engines: list[Child] = []
        self.predictors: list[Child] = []
        self.tagger: Child | None = None
        self.scheduler: Child | None = None
        self.model: str | None = None
        self._stopping = False
        self.crashes: list[dict[str, Any]] = []
        from rps_astro_cli.protocol.internal_auth import new_token

        # the cluster's internal token (protocol.internal_auth): in every child's
        # environment and in <run_dir>/internal-token (mode 0600), never on a command line
        self.internal_token: str | None = new_token() if cfg.internal_token else None
        self.token_file = self.run_dir / "internal-token"

    # -- children ----------------------------------------------------------------------
    def _child(self, name: str, role: str, argv: list[str], host: str = "127.0.0.1",
               env: dict[str, str] | None = None) -> Child:
        from rps_astro_cli.protocol.internal_auth import TOKEN_ENV

        token = {TOKEN_ENV: self.internal_token} if self.internal_token else {}
        return Child(name, role, argv, host, self.run_dir / f"{name}.log", self.run_dir / f"{name}.url",
                     {**token, **(env or {})})

    @property
    def children(self) -> list[Child]:
        out = [*self.engines]
        if self.tagger:
            out.append(self.tagger)
        out += self.predictors
        if self.scheduler:
            out.append(self.scheduler)
        return out

    def _engine_argv(self, i: int) -> list[str]:
        e = self.specs[i].engine
        argv = ["--backend", e.backend, "--profile", e.profile, "--instance-policy", e.instance_policy,
                "--seed", str(e.seed + i), "--time-scale", repr(e.time_scale), "--instance-id", f"engine-{i}"]
        for flag, val in (("--num-gpu-blocks", e.num_gpu_blocks), ("--max-num-seqs", e.max_num_seqs),
                          ("--max-num-batched-tokens", e.max_num_batched_tokens),
                          ("--max-model-len", e.max_model_len), ("--served-model-name", e.served_model_name)):
            if val is not None:
                argv += [flag, str(val)]
        if not e.chunked_prefill:
            argv.append("--no-chunked-prefill")
        if not e.enable_prefix_caching:
            argv.append("--no-enable-prefix-caching")
        for name, value in e.instance_policy_params.items():  # declared by the policy, checked by the recipe
            argv += ["--instance-param", f"{name}={value if isinstance(value, str) else json.dumps(value)}"]
        return argv + list(e.extra_args)

    def _predictor_argv(self, i: int, engine_url: str) -> list[str]:
        """Predictor i's flags: its engine, and the profile it simulates (its `assumed_profile`)."""
        p = self.cfg.predictor
        return ["--engine-url", engine_url, "--profile", self.specs[i].assumed_profile,
                "--status-cache-ms", repr(p.status_cache_ms), "--status-max-age-ms", repr(p.status_max_age_ms),
                "--extension-tokens", str(p.extension_tokens), "--default-output-tokens", str(p.default_output_tokens),
                "--calibration", p.calibration]

    def start(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Launch every child, wait until all are healthy, write cluster.json.
        `timeout_s` bounds each start phase (None: 60 s with sim engines, 900 s with real
        ones such as vllm).

        Returns:
            the cluster.json mapping.
        Raises:
            ClusterError: a child exited or did not become healthy in `timeout_s`
                (every started child is stopped first).
        """
        self._refuse_live_cluster()
        self._refuse_busy_port()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.internal_token:
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(self.internal_token + "\n")
        cfg = self.cfg
        if cfg.host and not _loopback(cfg.host) and not cfg.api_key:
            self.report(f"warning: the scheduler will listen on {cfg.host} without an API key: anyone who can "
                        "reach it can send requests; pass --api-key or set ASTRO_API_KEY (or bind 127.0.0.1)")
        if len({spec.engine.time_scale for spec in self.specs}) > 1:
            self.report(f"warning: the instance groups run at different time scales; the scheduler's prediction-error "
                        f"metrics and `astro bench` convert wall seconds by engine.time_scale {self.time_scale:g}")
        if timeout_s is None:
            timeout_s = START_TIMEOUT_S if cfg.engine.backend == "sim" else REAL_ENGINE_START_TIMEOUT_S
        import threading

        old_term = None
        if threading.current_thread() is threading.main_thread():  # SIGTERM while starting: stop all
            old_term = signal.signal(signal.SIGTERM, _interrupt)
        try:
            self.engines = [self._child(f"engine-{i}", "engine", self._engine_argv(i)) for i in range(len(self.specs))]
            if cfg.tagger.enabled:
                argv = ["--profile", self.specs[0].profile]  # prices media tokens: the fleet serves one model
                if cfg.tagger.length_model:
                    argv += ["--length-model", cfg.tagger.length_model]
                self.tagger = self._child("tagger", "tagger", argv)
            phase1 = self.engines + ([self.tagger] if self.tagger else [])
            for c in phase1:
                c.launch()
            self._wait_ready(phase1, timeout_s)
            self.model = self._served_model(self.engines[0])
            if cfg.predictor.enabled and not cfg.predictor.in_process:
                self.predictors = [self._child(f"predictor-{i}", "predictor", self._predictor_argv(i, e.url or ""))
                                   for i, e in enumerate(self.engines)]
                for c in self.predictors:
                    c.launch()
                self._wait_ready(self.predictors, timeout_s)
            s = cfg.scheduler
            argv = []
            for e in self.engines:
                argv += ["--engine", e.url or ""]
            for pr in self.predictors:
                argv += ["--predictor", pr.url or ""]
            if self.tagger:
                argv += ["--tagger", self.tagger.url or ""]
            elif cfg.tagger.length_model:  # no tagger service: the scheduler tags in-process
                argv += ["--length-model", cfg.tagger.length_model]
            argv += ["--policy", s.policy, "--k", str(s.k), "--objective", s.objective,
                     "--llumnix-variant", s.llumnix_variant, "--predict-deadline-ms", repr(s.predict_deadline_ms),
                     "--tag-deadline-ms", repr(s.tag_deadline_ms), "--health-interval-ms", repr(s.health_interval_ms),
                     "--status-interval-ms", repr(s.status_interval_ms), "--max-body-bytes", str(s.max_body_bytes),
                     "--seed", str(s.seed), "--profile", self.specs[0].profile,
                     "--decisions-kept", str(s.decisions_kept)] + (["--oracle-lengths"] if s.oracle_lengths else [])
            argv += [] if s.early_dispatch else ["--no-early-dispatch"]
            argv += [] if s.late_tag else ["--no-late-tag"]
            argv += ["--prefix-tokenizer", s.prefix_tokenizer, "--tokenize-deadline-ms", repr(s.tokenize_deadline_ms),
                     "--health-timeout-ms", repr(s.health_timeout_ms), "--admission", s.admission,
                     "--calibration", cfg.predictor.calibration]
            for name, spec in s.slo_classes.items():  # checked by the recipe
                argv += ["--slo-class", f"{name}:" + ",".join(f"{k}={v}" for k, v in spec.items() if v is not None)]
            if cfg.predictor.enabled and cfg.predictor.in_process:  # the look-ahead per engine: its own profile
                argv += ["--predict-in-process"]
                for spec in self.specs:
                    argv += ["--predictor-profile", spec.assumed_profile]
            if cfg.engine.backend == "sim" and self.time_scale != 1.0:  # observed wall s → engine s
                argv += ["--time-scale", repr(self.time_scale)]
            for name, value in s.params.items():  # the policy's declared parameters (checked by the recipe)
                argv += ["--param", f"{name}={value if isinstance(value, str) else json.dumps(value)}"]
            env = {"ASTRO_API_KEY": cfg.api_key} if cfg.api_key else {}
            self.scheduler = self._child("scheduler", "scheduler", argv, host=cfg.host, env=env)
            self.scheduler.port = s.port
            self.scheduler.launch()
            self._wait_ready([self.scheduler], timeout_s)
        except BaseException:
            self.stop()
            raise
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
        return self.write_cluster_json()

    def _json_paths(self) -> list[Path]:
        return [self.run_dir / "cluster.json", *([self.cluster_json] if self.cluster_json else [])]

    def write_cluster_json(self) -> dict[str, Any]:
        """Write `describe()` to `<run_dir>/cluster.json` and `cluster_json` (each replaced
        whole, so a reader never sees half a file); returns it."""
        if self.created_unix_s is None:
            self.created_unix_s = time.time()
        info = self.describe()
        text = json.dumps(info, indent=1) + "\n"
        for path in self._json_paths():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        return info

    def _refuse_live_cluster(self) -> None:
        """Raise ClusterError when a cluster.json this supervisor would write names a live
        astro process: another `astro serve` owns it, and overwriting it would point
        `astro bench` at the wrong cluster."""
        for path in self._json_paths():
            pid = live_cluster_pid(path)
            if pid is not None:
                raise ClusterError(f"{path} belongs to a running cluster (pid {pid} is alive); stop that "
                                   "`astro serve` first (Ctrl-C in its terminal), or pass another --cluster-json "
                                   "(or run in another folder)")

    def _refuse_busy_port(self) -> None:
        """Raise ClusterError, in one line, when the scheduler's fixed port is taken (port 0:
        the OS picks a free one, nothing to check)."""
        port, host = self.cfg.scheduler.port, self.cfg.host
        if not port:
            return
        import errno
        import socket

        # bound as the scheduler binds it (SO_REUSEADDR: a port in TIME_WAIT is free), then let go
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ClusterError(f"port {port} on {host} is in use (the scheduler's --port); stop what "
                                       "listens there, or pass another --port (0 = any free port)") from None
                raise ClusterError(f"the scheduler cannot listen on {host}:{port} ({exc.strerror or exc}); check "
                                   "--host and --port") from None

    def _wait_ready(self, children: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(children)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for c in list(pending):
                    assert c.proc is not None
                    if c.proc.poll() is not None:
                        if (line := _bind_error(c.log_tail(40))) is not None:  # one line, not its command line
                            raise ClusterError(f"{c.name}: {line} (log {c.log_path})")
                        raise ClusterError(f"{c.name} exited with code {c.proc.returncode} while starting "
                                           f"(log {c.log_path}):\n{c.log_tail()}")
                    if c.url is None and c.ready_path.is_file():
                        text = c.ready_path.read_text().strip()
                        if text:
                            c.url = text
                            c.port = int(text.rsplit(":", 1)[1])
                    if c.url is not None:
                        try:
                            if client.get(c.url + "/health").status_code < 500:
                                pending.remove(c)
                        except httpx.HTTPError:
                            pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise ClusterError(f"{names} not healthy after {timeout_s:.0f} s "
                                       f"(log {pending[0].log_path}):\n{pending[0].log_tail()}")
                if pending:
                    time.sleep(0.05)

    def _served_model(self, engine: Child) -> str | None:
        try:
            from rps_astro_cli.protocol.internal_auth import token_headers

            r = httpx.get(f"{engine.url}/v1/models", timeout=2.0, headers=token_headers(self.internal_token))
            data = r.json().get("data") or []
            return data[0]["id"] if data else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    # -- description -------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The cluster.json mapping (schema in the module docstring)."""
        cfg = self.cfg
        s = cfg.scheduler
        sched_url = self.scheduler.url if self.scheduler else None
        recipe = cfg.model_dump()
        recipe.pop("api_key", None)
        return {
            "schema": CLUSTER_SCHEMA,
            "name": cfg.name,
            "created_unix_s": self.created_unix_s if self.created_unix_s is not None else time.time(),
            "scheduler": {"url": sched_url, "openai_base_url": f"{sched_url}/v1", "metrics_url": f"{sched_url}/metrics",
                          "decisions_url": f"{sched_url}/decisions",
                          "pid": self.scheduler.pid if self.scheduler else None},
            "tagger": {"url": self.tagger.url, "pid": self.tagger.pid} if self.tagger else None,
            "instances": [
                {"name": e.name, "engine_url": e.url, "status_url": f"{e.url}/status",
                 "metrics_url": f"{e.url}/metrics",
                 "predictor_url": self.predictors[i].url if self.predictors else None,
                 "predictor_metrics_url": f"{self.predictors[i].url}/metrics" if self.predictors else None,
                 "engine_pid": e.pid, "predictor_pid": self.predictors[i].pid if self.predictors else None,
                 "profile": self.specs[i].profile,
                 "assumed_profile": self.specs[i].assumed_profile if cfg.predictor.enabled else None,
                 "time_scale": self.specs[i].engine.time_scale}
                for i, e in enumerate(self.engines)],
            "policy": {"name": s.policy, **s.policy_params()},
            "profile": self.specs[0].profile,
            "model": self.model,
            "time_scale": self.time_scale,
            "instance_policy": cfg.engine.instance_policy,
            "api_key_required": bool(cfg.api_key),
            "internal_token_file": str(self.token_file) if self.internal_token else None,
            "log_dir": str(self.run_dir),
            "recipe": recipe,
        }

    # -- supervision -------------------------------------------------------------------
    def poll_once(self) -> None:
        """Check every child once: report and restart (or give up on) the exited ones. A
        child is restarted when it has had fewer than `cfg.restart_crashed` restarts in the
        last `restart_window_s` seconds (older ones are forgiven); cluster.json then gets
        the new pid (or none, given up).

        Raises:
            ClusterError: the scheduler died and may not be restarted.
        """
        changed = False
        try:
            for c in self.children:
                if self._stopping or c.proc is None or c.proc.poll() is None:
                    continue
                changed = True
                code = c.proc.returncode
                crash = {"child": c.name, "pid": c.proc.pid, "exit_code": code, "log": str(c.log_path),
                         "time_unix_s": time.time()}
                self.crashes.append(crash)
                tail = c.log_tail(4)
                now = self.clock()
                c.restart_times = [t for t in c.restart_times if now - t < self.restart_window_s]
                budget, window = self.cfg.restart_crashed, f"{self.restart_window_s:g} s"
                if len(c.restart_times) < budget:
                    c.restarts += 1
                    c.restart_times.append(now)
                    self.report(f"child {c.name} (pid {c.proc.pid}) exited with code {code}; restarting on port "
                                f"{c.port} ({len(c.restart_times)}/{budget} in {window}); log {c.log_path}"
                                + (f"\n{tail}" if tail else ""))
                    c.launch()
                else:
                    self.report(f"child {c.name} (pid {c.proc.pid}) exited with code {code}; not restarting "
                                f"(restart budget {budget} in {window} spent); log {c.log_path}"
                                + (f"\n{tail}" if tail else ""))
                    c.proc = None
                    if c is self.scheduler:
                        raise ClusterError("the scheduler is down; stopping the cluster")
        finally:
            if changed and not self._stopping and self.created_unix_s is not None:
                try:
                    self.write_cluster_json()  # the restarted child's pid, not the dead one's
                except OSError as exc:
                    self.report(f"warning: cannot rewrite cluster.json: {exc}")

    def supervise(self, poll_s: float = 0.2) -> int:
        """Watch the children until SIGINT/SIGTERM (then stop them all). Blocking.

        Returns:
            exit code: 0 after a requested stop, 1 when the cluster could not go on.
        """
        stop = {"sig": None}

        def _on_signal(signum, _frame):
            stop["sig"] = signum

        old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            while stop["sig"] is None:
                try:
                    self.poll_once()
                except ClusterError as exc:
                    self.report(f"error: {exc}")
                    code = 1
                    break
                time.sleep(poll_s)
            if stop["sig"] is not None:
                self.report(f"received {signal.Signals(stop['sig']).name}; stopping {len(self.children)} children")
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)
        return code

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child (scheduler first, engines last), SIGKILL after `grace_s`."""
        self._stopping = True
        live = [c for c in reversed(self.children) if c.proc is not None and c.proc.poll() is None]
        for c in live:
            try:
                c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for c in live:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                c.proc.kill()  # type: ignore[union-attr]
                try:
                    c.proc.wait(grace_s)  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:  # unkillable (D state): report, never hang
                    pid = c.proc.pid  # type: ignore[union-attr]
                    self.report(f"warning: {c.name} (pid {pid}) did not exit after SIGKILL")

    def __enter__(self) -> ClusterSupervisor:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bind_error(tail: str) -> str | None:
    """The child's one-line "cannot listen on HOST:PORT" error in the last start of its log
    (`tail`), without its "error: " prefix; None when it did not fail to bind."""
    last = tail.rsplit("\n--- start ", 1)[-1]
    line = next((ln.strip() for ln in last.splitlines() if "cannot listen on" in ln), None)
    return line.removeprefix("error:").strip() if line else None


def live_cluster_pid(path: Path) -> int | None:
    """A pid named in the cluster.json at `path` whose process is alive and is an astro
    process (its command line names rps_astro_cli, where /proc tells: a pid reused by an
    unrelated process after a reboot does not count); None when there is none, or no
    readable cluster.json."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    def pid(d: Any, key: str = "pid") -> Any:
        return d.get(key) if isinstance(d, dict) else None

    insts = info.get("instances")
    pids = [pid(info.get("scheduler")), pid(info.get("tagger"))]
    for inst in insts if isinstance(insts, list) else ():
        pids += [pid(inst, "engine_pid"), pid(inst, "predictor_pid")]
    for p in pids:
        if isinstance(p, int) and not isinstance(p, bool) and p > 0 and p != os.getpid() and _astro_alive(p):
            return p
    return None


def _astro_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    except OSError:
        return False
    try:
        return b"rps_astro_cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # gone meanwhile, or no /proc (not Linux: alive is all we know)
        return not Path("/proc/self").exists()
    except OSError:
        return True


def _loopback(host: str) -> bool:
    from rps_astro_cli.protocol.internal_auth import is_loopback

    return is_loopback(host)


def default_run_dir() -> Path:
    """`runs/serve-<UTC time>-<pid>` under the current directory."""
    return Path("runs") / f"serve-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"


__all__ = ["CLUSTER_SCHEMA", "Child", "ClusterError", "ClusterSupervisor", "default_run_dir"]

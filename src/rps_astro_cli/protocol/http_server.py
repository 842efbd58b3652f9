"""HTTP serving helpers shared by the sim engine and the services: a TCP_NODELAY
listening socket, uvicorn on it until interrupted (printing `ready: URL` for
supervisors), and a background server thread for tests and whole-cluster mode."""

from __future__ import annotations

import socket
import threading
import time

from fastapi import FastAPI


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 asks the OS for a free port.

    Raises:
        AstroUserError: the address cannot be bound (in use, bad host).
    """
    from rps_astro_cli.errors import AstroUserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0) so asyncio sets TCP_NODELAY on accepted connections; and
    # NODELAY on the listener (Linux inherits it): without it, small SSE writes wait for
    # the client's delayed ACK (~40 ms per response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AstroUserError(f"cannot listen on {host}:{port}: {exc.strerror}", field="--port",
                             fix="pick a free port or 0 for any") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_server(app: FastAPI, log_level: str):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=30,
                            lifespan="on", timeout_graceful_shutdown=2)
    return uvicorn.Server(config)


def serve_blocking(app: FastAPI, host: str, port: int, log_level: str = "warning",
                   ready_file: str | None = None, *, use_uvloop: bool = False) -> None:
    """Serve `app` with uvicorn on host:port (port 0 = any free port) until interrupted
    (blocking). Once listening, prints `ready: http://HOST:PORT` on stdout and writes that
    URL to `ready_file` (when given), so a supervisor can learn the port. `use_uvloop`
    runs the event loop on uvloop when it is installed (else asyncio). Shared by the
    engine (`engine.sim_server.run_engine`) and the services (`services.http_common.run_app`).

    Raises:
        AstroUserError: the address cannot be bound.
    """
    import asyncio

    sock = bind_socket(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    server = _uvicorn_server(app, log_level)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            print(f"ready: {url}", flush=True)
            if ready_file:
                with open(ready_file, "w") as fh:
                    fh.write(url + "\n")
        await task

    run = asyncio.run
    if use_uvloop:
        try:
            import uvloop  # optional speed-up (uvicorn's "standard" extra)

            run = uvloop.run
        except ImportError:  # pragma: no cover
            pass
    try:
        run(main())
    except KeyboardInterrupt:
        pass


class ServerThread:
    """Serve an app on 127.0.0.1:<free port> in a background thread (tests, `astro serve`
    whole-cluster mode). Use as a context manager; `url` is the base URL.

    Raises:
        RuntimeError: the server did not come up within `timeout_s`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", timeout_s: float = 20.0):
        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = _uvicorn_server(app, log_level)
        self.thread = threading.Thread(target=self._run, daemon=True, name="astro-server")
        self.timeout_s = timeout_s

    def _run(self) -> None:
        import asyncio

        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

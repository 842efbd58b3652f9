"""Engine backends behind `astro serve engine --backend NAME`.

A backend is a callable `run(options: EngineOptions, extra_args: list[str]) -> None` that
serves until interrupted. `extra_args` are the command-line arguments astro does not
know (everything unrecognised after `astro serve engine ...`), passed through untouched,
e.g. vLLM's own flags for the "vllm" backend.

Registration: `@ENGINE_BACKENDS.register("name")` on the callable. Built in: "sim" (this
module). Other backends live in their own module named `rps_astro_cli.engine.<name>_backend`
(e.g. `vllm_backend` registers "vllm"), imported lazily by `get_backend` the first time
the name is asked for, so `astro --help` never imports vllm.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.registry import Registry


@dataclass(frozen=True)
class EngineOptions:
    """The options `astro serve engine` knows (every backend gets them).

    profile: execution-profile id or JSON path. host/port: listen address (port 0 = any
    free port). instance_policy: in-instance policy name; instance_policy_params: its
    declared parameters (already checked by `policies.make_policy`'s declaration). seed: seed of the engine's
    Generator. time_scale: wall seconds per engine second (sim only). instance_id: name in
    /status. num_gpu_blocks / max_num_seqs / max_num_batched_tokens / max_model_len:
    overrides of the profile's limits (None = the profile's). chunked_prefill: False =
    prioritized prefill. api_key: Bearer key for /v1 routes (None = open).
    max_body_bytes: request body bound (bytes). allow_remote_media: accept public
    http(s) media URLs. served_model_name: model name clients use (None = the profile's).
    ready_file: write the base URL here once listening. tokenizer: a local Hugging Face
    tokenizer folder for prompt counting (None = `tokens.count_tokens_fallback`).
    """

    profile: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    instance_policy: str = "fcfs"
    instance_policy_params: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    time_scale: float = 1.0
    instance_id: str = "engine-0"
    num_gpu_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # vLLM V1's automatic prefix caching (False: --no-enable-prefix-caching)
    api_key: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    allow_remote_media: bool = False
    served_model_name: str | None = None
    ready_file: str | None = None
    tokenizer: str | None = None


EngineBackend = Callable[[EngineOptions, list[str]], None]
ENGINE_BACKENDS: Registry[EngineBackend] = Registry("engine backend")


def get_backend(name: str) -> EngineBackend:
    """The backend registered as `name`, importing `rps_astro_cli.engine.<name>_backend`
    on first use.

    Raises:
        AstroUserError: no such backend (lists the known ones), or its module failed to
            import (e.g. an optional extra is not installed).
    """
    if name not in ENGINE_BACKENDS and name.isidentifier():
        modname = f"rps_astro_cli.engine.{name}_backend"
        try:
            importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name != modname:
                raise AstroUserError(f"backend {name!r} needs {exc.name!r}, which is not installed",
                                     field="--backend",
                                     fix=f"pip install 'rps_astro_cli[{name}]'") from None
    return ENGINE_BACKENDS.get(name)


def build_sim_engine(opts: EngineOptions):
    """A `SimEngine` for `opts` (profile loaded, limits overridden).

    Raises:
        AstroUserError: unknown profile / policy, bad limits or time_scale.
    """
    from rps_astro_cli.engine.sim_engine import SimEngine
    from rps_astro_cli.sim.profile import load_profile

    profile = load_profile(opts.profile)
    from rps_astro_cli.policies.build import build_instance_policy

    policy: Any = build_instance_policy(opts.instance_policy, opts.instance_policy_params, profile)
    return SimEngine(
        profile, policy=policy, seed=opts.seed, time_scale=opts.time_scale,
        instance_id=opts.instance_id, num_gpu_blocks=opts.num_gpu_blocks,
        max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
        max_model_len=opts.max_model_len, chunked_prefill=None if opts.chunked_prefill else False,
        enable_prefix_caching=None if opts.enable_prefix_caching else False,
    )


@ENGINE_BACKENDS.register("sim")
def run_sim(opts: EngineOptions, extra_args: list[str]) -> None:
    """Serve the embedded sim engine (blocking).

    Raises:
        AstroUserError: extra arguments given (the sim backend takes none), or bad options.
    """
    if extra_args:
        raise AstroUserError(f"the sim backend takes no extra arguments, got {' '.join(extra_args)}",
                             field="--backend", fix="drop them or use --backend vllm")
    from rps_astro_cli.engine.sim_server import run_engine
    from rps_astro_cli.protocol.openai_types import ApiLimits
    from rps_astro_cli.tokens import load_codec, load_counter

    if opts.max_body_bytes <= 0:
        raise AstroUserError(f"must be > 0, got {opts.max_body_bytes}", field="--max-body-bytes")
    counter = load_counter(opts.tokenizer)
    engine = build_sim_engine(opts)
    limits = ApiLimits(max_body_bytes=opts.max_body_bytes, allow_remote_media=opts.allow_remote_media)
    run_engine(engine, host=opts.host, port=opts.port, api_key=opts.api_key, limits=limits,
               served_model_name=opts.served_model_name, ready_file=opts.ready_file, counter=counter,
               codec=load_codec(opts.tokenizer))

"""`astro serve engine`: run one engine backend (the embedded sim engine by default).

Arguments astro does not know are passed through to the backend (e.g. vLLM's flags for
`--backend vllm`); the sim backend refuses them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from rps_astro_cli.cli.common import InstanceParamOpt, SeedOpt, user_errors, warn_key_on_command_line


def register(serve_app: typer.Typer) -> None:
    """Add the `engine` command to the serve group."""

    @serve_app.command(
        "engine",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @user_errors
    def engine(
        ctx: typer.Context,
        backend: Annotated[str, typer.Option("--backend", help="Engine backend: sim (embedded) or vllm.")] = "sim",
        profile: Annotated[str, typer.Option("--profile", help="Execution profile id (artifacts/profiles/<id>.json) or a JSON path.")] = "llama-2-7b-a30",
        host: Annotated[str, typer.Option("--host", help="Listen address (127.0.0.1 unless you mean to expose it).")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="Listen port (0 = any free port; the URL is printed as 'ready: URL').")] = 8000,
        instance_policy: Annotated[str, typer.Option("--instance-policy", help="In-instance scheduling policy (fcfs, ...).")] = "fcfs",
        instance_param: InstanceParamOpt = None,
        seed: SeedOpt = 0,
        time_scale: Annotated[float, typer.Option("--time-scale", help="Wall seconds per engine second: 1.0 = real time, 0.1 = 10x faster.")] = 1.0,
        instance_id: Annotated[str, typer.Option("--instance-id", help="Instance name shown in /status.")] = "engine-0",
        num_gpu_blocks: Annotated[int | None, typer.Option("--num-gpu-blocks", help="Override the profile's KV blocks.")] = None,
        max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs", help="Override the profile's batch size limit.")] = None,
        max_num_batched_tokens: Annotated[int | None, typer.Option("--max-num-batched-tokens", help="Override the profile's per-step token budget.")] = None,
        max_model_len: Annotated[int | None, typer.Option("--max-model-len", help="Override the profile's context limit (prompt + output).")] = None,
        no_chunked_prefill: Annotated[bool, typer.Option("--no-chunked-prefill", help="Prioritized prefill instead of chunked prefill.")] = False,
        no_prefix_caching: Annotated[bool, typer.Option("--no-enable-prefix-caching", help="Turn off automatic prefix caching (on by default, as in vLLM V1).")] = False,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="ASTRO_API_KEY", callback=warn_key_on_command_line, help="Require 'Authorization: Bearer KEY' on /v1 routes (env ASTRO_API_KEY).")] = None,
        max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (bytes; larger gets 413).")] = 16 * 1024 * 1024,
        allow_remote_media: Annotated[bool, typer.Option("--allow-remote-media", help="Accept http(s) image/video URLs (public addresses only).")] = False,
        served_model_name: Annotated[str | None, typer.Option("--served-model-name", help="Model name clients send (default: the profile's model).")] = None,
        ready_file: Annotated[str | None, typer.Option("--ready-file", help="Write the base URL to this file once listening.")] = None,
        tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Local Hugging Face tokenizer folder for prompt counting (default: astro's documented fallback counter).")] = None,
    ) -> None:
        """Serve an OpenAI-compatible engine (sim: the instance model in wall-clock time)."""
        from rps_astro_cli.engine.backends import EngineOptions, get_backend
        from rps_astro_cli.params import check_params, parse_assignments
        from rps_astro_cli.policies import INSTANCE_POLICIES

        iparams = parse_assignments(instance_param, "--instance-param")
        iparams = check_params(INSTANCE_POLICIES.get(instance_policy).params, iparams,
                               owner=f"instance policy {instance_policy}",
                               fields={n: f"--instance-param {n}" for n in iparams})
        opts = EngineOptions(
            profile=profile, host=host, port=port, instance_policy=instance_policy,
            instance_policy_params=iparams, seed=seed,
            time_scale=time_scale, instance_id=instance_id, num_gpu_blocks=num_gpu_blocks,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, chunked_prefill=not no_chunked_prefill,
            enable_prefix_caching=not no_prefix_caching,
            api_key=api_key or None, max_body_bytes=max_body_bytes,
            allow_remote_media=allow_remote_media, served_model_name=served_model_name,
            ready_file=ready_file, tokenizer=tokenizer,
        )
        get_backend(backend)(opts, list(ctx.args))


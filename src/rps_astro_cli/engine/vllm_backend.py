"""The "vllm" engine backend: `astro serve engine --backend vllm --model PATH_OR_NAME
[vLLM flags...]` (registered in `engine.backends.ENGINE_BACKENDS`, imported lazily).

astro's own options map onto vLLM flags: `--instance-policy` → the plugin's policy,
`--instance-id` / `--profile` → `/status` fields, `--num-gpu-blocks` →
`--num-gpu-blocks-override`, `--max-num-seqs`, `--max-num-batched-tokens`,
`--max-model-len`, `--no-chunked-prefill` → `--no-enable-chunked-prefill`, `--api-key` (as
vLLM's `VLLM_API_KEY` in its environment, not on its command line),
`--served-model-name`. Everything else astro does not know (including `--model`) goes
to vLLM untouched. vLLM's own output goes to this process's stdout/stderr. Prints
`ready: URL` once `/health` and `/status` answer, like the sim
engine, then serves until interrupted (SIGINT/SIGTERM stop the whole vLLM process group).
The startup wait is `$ASTRO_VLLM_READY_TIMEOUT_S` seconds (default 900).

Several engines on one multi-GPU host (`astro serve --recipe ...` with `instances: N`):
set `ASTRO_VLLM_DEVICES` to a comma list of device groups separated by `;` or single
ids separated by `,` (e.g. `0,1,2,3`, or `0,1;2,3` for two TP=2 engines); the engine whose
instance id ends in `-i` gets `CUDA_VISIBLE_DEVICES` = group `i mod len(groups)`.
"""

from __future__ import annotations

import os
import signal
import sys

from rps_astro_cli.engine.backends import ENGINE_BACKENDS, EngineOptions
from rps_astro_cli.engine.vllm_launch import _flag_present, launch_vllm_engine
from rps_astro_cli.errors import AstroUserError


def devices_for(instance_id: str, spec: str) -> str | None:
    """The `CUDA_VISIBLE_DEVICES` value for `instance_id` under `ASTRO_VLLM_DEVICES=spec`
    (see module docstring); None when `spec` is empty.

    Raises:
        AstroUserError: the instance id has no `-<index>` suffix.
    """
    if not spec.strip():
        return None
    groups = [g.strip() for g in (spec.split(";") if ";" in spec else spec.split(",")) if g.strip()]
    tail = instance_id.rsplit("-", 1)[-1]
    if not tail.isdigit():
        raise AstroUserError(f"instance id {instance_id!r} does not end in -<index>",
                             field="ASTRO_VLLM_DEVICES", fix="use --instance-id engine-<i> or unset it")
    return groups[int(tail) % len(groups)]


def vllm_args_from_options(opts: EngineOptions, extra_args: list[str]) -> tuple[str, list[str]]:
    """Split `extra_args` into (model, remaining vLLM flags) and add the flags that astro's
    own options imply (an explicit vLLM flag in `extra_args` wins).

    Raises:
        AstroUserError: `--model` missing or given without a value.
    """
    args = list(extra_args)
    model = None
    for i, a in enumerate(args):
        if a == "--model":
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise AstroUserError("needs a value", field="--model",
                                     fix="--model PATH_OR_NAME (a local folder or a model name)")
            model = args[i + 1]
            del args[i:i + 2]
            break
        if a.startswith("--model="):
            model = a.split("=", 1)[1]
            del args[i]
            break
    if not model:
        raise AstroUserError("the vllm backend needs the model to serve", field="--model",
                             fix="add --model PATH_OR_NAME")
    implied: list[tuple[str, object]] = [
        ("--num-gpu-blocks-override", opts.num_gpu_blocks),
        ("--max-num-seqs", opts.max_num_seqs),
        ("--max-num-batched-tokens", opts.max_num_batched_tokens),
        ("--max-model-len", opts.max_model_len),
        ("--served-model-name", opts.served_model_name),
    ]
    for flag, val in implied:
        if val is not None and not _flag_present(args, flag):
            args += [flag, str(val)]
    if not opts.chunked_prefill and not _flag_present(args, "--enable-chunked-prefill") \
            and not _flag_present(args, "--no-enable-chunked-prefill"):
        args.append("--no-enable-chunked-prefill")
    if not opts.enable_prefix_caching and not _flag_present(args, "--enable-prefix-caching") \
            and not _flag_present(args, "--no-enable-prefix-caching"):
        args.append("--no-enable-prefix-caching")
    return model, args


def vllm_env(opts: EngineOptions, devices: str | None) -> dict[str, str] | None:
    """The vLLM server's extra environment: its devices, and the API key as vLLM's own
    `VLLM_API_KEY` — never `--api-key` on its command line, which every local user could
    read in `ps` (issue 29)."""
    env: dict[str, str] = {}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if opts.api_key:
        env["VLLM_API_KEY"] = opts.api_key
    return env or None


@ENGINE_BACKENDS.register("vllm")
def run_vllm(opts: EngineOptions, extra_args: list[str]) -> None:
    """Serve a real vLLM engine with astro's plugin (blocking; see module docstring).

    Raises:
        AstroUserError: bad options (no --model, reserved flag, unknown policy, no vllm).
        RuntimeError: the server died or did not become ready.
    """
    model, args = vllm_args_from_options(opts, extra_args)
    dev = devices_for(opts.instance_id, os.environ.get("ASTRO_VLLM_DEVICES", ""))
    eng = launch_vllm_engine(model, host=opts.host, port=opts.port, policy=opts.instance_policy,
                             policy_params=dict(opts.instance_policy_params),
                             extra_args=args, instance_id=opts.instance_id,
                             profile_id=opts.profile or "", log_path="-", env=vllm_env(opts, dev))
    stopping = False

    def _stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _stop)
    try:
        timeout = float(os.environ.get("ASTRO_VLLM_READY_TIMEOUT_S", "900"))
        waited = eng.wait_ready(timeout_s=timeout)
        print(f"ready: {eng.base_url}", flush=True)
        print(f"vLLM ready after {waited:.1f} s", file=sys.stderr, flush=True)
        if opts.ready_file:
            with open(opts.ready_file, "w") as fh:
                fh.write(eng.base_url + "\n")
        rc = eng.proc.wait()
        if rc != 0 and not stopping:
            raise RuntimeError(f"vLLM server exited with code {rc}; log tail:\n{eng.log_tail()}")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        eng.stop()

"""Bench workloads: a registry of dataset loaders, each driven by one seeded
`numpy.random.Generator`, all returning the same `Workload` of `BenchRequest`s.

| name | input | what a request is |
| --- | --- | --- |
| `sharegpt` | ShareGPT JSON `[{id, conversations:[{from, value}]}]` | first human turn → prompt, the gpt turn after it → reference reply |
| `llava-instruct` | LLaVA-Instruct JSON `{id, image, conversations}` + image folder | first human turn with `<image>` removed, one image |
| `llava-video` | LLaVA-Video JSON `{id, video, conversations, data_source}` + video folder | first human turn, one video of `--max-frames` frames |
| `burstgpt` | BurstGPT CSV v1 (6 columns) or v3 (8 columns), read by column name | `Request tokens` / `Response tokens`, `Timestamp` |
| `azure` | Azure LLM inference trace CSV `TIMESTAMP,ContextTokens,GeneratedTokens` | lengths + timestamps |
| `length-trace` | Astrolabe length CSV `num_prefill_tokens,num_decode_tokens,...` | lengths only |
| `sharegpt --multi-turn` | ShareGPT JSON | every (human, gpt) turn of a conversation; prompt = the whole history; sent a think time after the previous reply |
| `mooncake` | Mooncake JSONL `{timestamp (ms), input_length, output_length, hash_ids}` | a prompt whose 512-token blocks repeat where `hash_ids` repeat (docs/workloads-mooncake.md) |
| `shared-prefix` | none | one of 8 synthetic 1024-token system prompts + a user message (prefix-cache traffic) |
| `synthetic` | none | ShareGPT-like lengths (see `workloads_traces.SYNTHETIC_STATS`) |
| `custom` | JSONL `{"prompt": str, "output_tokens": int}` (vLLM's custom format; `output_len` accepted; missing → `--output-len`) | one row |
| `random` | none | fixed ISL/OSL: `--input-len`-token synthetic prompt, `--output-len`-token reply |
| `mix-to` / `mix-ml` / `mix-mh` | ShareGPT + LLaVA-Instruct + LLaVA-Video | RPS-Serve's TO / ML / MH mixes (see `workloads_chat.MIXES`) |

Data resolution (stated in every report as `Workload.source`): `--path` if given, else
the data folder (`$ASTRO_DATA_DIR`, else `../shared/data` beside the checkout; see
`data_paths.data_dir`), else the Hugging Face hub through `datasets` when it is installed
and online (ShareGPT only), else the synthetic generator (with a warning).

Loaders live in `workloads_chat` (ShareGPT, LLaVA, mixes) and `workloads_traces` (CSV
traces, synthetic); `workload_base` holds the types and the registry; importing this module
registers every loader. `--sampling vllm` draws sharegpt / custom / random exactly as
`vllm bench serve` does for the same file and seed (`workloads_vllm`). Token counts use `rps_astro_cli.tokens` (the counter the engine and Predictor use).
Lengths-only datasets get a synthetic prompt text with exactly the trace's token count
under the fallback counter (`synthetic_prompt`).
"""  # noqa: E501  (the table rows)

from rps_astro_cli.bench import workloads_chat as _chat  # noqa: F401  (registers sharegpt, llava-*, mix-*)
from rps_astro_cli.bench import workloads_traces as _traces  # noqa: F401  (registers the traces, synthetic)
from rps_astro_cli.bench import workloads_vllm as _vllm  # noqa: F401  (registers custom, random)
from rps_astro_cli.bench.workload_base import WORKLOADS, load_workload

# The registry and its entry point, importable from here so that the caller gets every
# loader registered; the types (`BenchRequest`, `Workload`, `WorkloadOptions`, ...) are
# imported from `workload_base` only.
__all__ = ["WORKLOADS", "load_workload"]

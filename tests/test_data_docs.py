"""docs/data.md names every file astro looks for in the data folder (`data_paths.data_dir`),
and no user-facing doc points at `../shared/`, a folder users do not have."""

from __future__ import annotations

from pathlib import Path

from rps_astro_cli.bench import workloads_chat as chat
from rps_astro_cli.bench import workloads_traces as traces
from rps_astro_cli.data_paths import REPO_ROOT


def expected_files() -> set[str]:
    """Every path, relative to the data folder, that a loader tries (the loaders' own
    constants, so a new one cannot be left out of the doc)."""
    from rps_astro_cli.cli.simulate import _DATASETS

    names: set[str] = set()
    for group in (chat.SHAREGPT_FILES, chat.LLAVA_FILES, chat.LLAVA_VIDEO_FILES, chat.COMPLEX_REASONING_FILES,
                  (chat.LLAVA_BENCH_QA,), traces.BURSTGPT_FILES, traces.AZURE_FILES, traces.LENGTH_TRACE_FILES,
                  traces.MOONCAKE_FILES, tuple(_DATASETS.values())):
        names.update(group)
    # the fixed paths of `astro length` (its default data), `astro profile` (prompt text) and the media folders
    names.update({"sharegpt/sharegpt_v3_sample500.json", "sharegpt/sharegpt_v3_prompts500.json", "llava/images",
                  "llava_video"})
    return names


def test_data_doc_names_every_file_the_loaders_expect():
    doc = (REPO_ROOT / "docs" / "data.md").read_text()
    names = expected_files()
    assert len(names) > 15  # the constants were found
    missing = sorted(n for n in names if n not in doc)
    assert not missing, missing
    for url in ("huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered",
                "huggingface.co/datasets/liuhaotian/LLaVA-Instruct-150K",
                "huggingface.co/datasets/lmms-lab/LLaVA-Video-178K", "github.com/HPMLL/BurstGPT",
                "github.com/Azure/AzurePublicDataset", "github.com/AKafakA/Astrolabe",
                "github.com/kvcache-ai/Mooncake"):
        assert url in doc, url  # each dataset's public source
    assert "ASTRO_DATA_DIR" in doc


def test_no_user_doc_points_at_shared():
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]  # not docs/experiments/
    offenders = [str(p.relative_to(REPO_ROOT)) for p in docs
                 if p.name != "BENCHMARKS.md" and "../shared/" in p.read_text()]
    assert not offenders, offenders


def test_no_data_warning_points_at_the_data_doc(tmp_path, monkeypatch):
    from rps_astro_cli.data_paths import data_dir_problem

    monkeypatch.setenv("ASTRO_DATA_DIR", str(tmp_path / "typo"))
    msg = data_dir_problem()
    assert msg is not None and "docs/data.md" in msg
    assert Path(REPO_ROOT / "docs" / "data.md").is_file()

"""Workload loaders and arrival processes on hand-written inputs with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from rps_astro_cli.bench.arrivals import ArrivalSpec, arrival_times, parse_positive, parse_rates
from rps_astro_cli.bench.workload_base import WorkloadOptions, synthetic_prompt
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.bench.workloads_chat import MIXES
from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import count_tokens_fallback

RNG = np.random.default_rng


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_sharegpt_filtering_counts(tmp_path):
    long = "word " * 1100  # 1100 tokens > 1024
    entries = [
        {"id": "ok", "conversations": [{"from": "human", "value": "how are you today"},
                                        {"from": "gpt", "value": "fine thanks and you"}]},
        {"id": "gptfirst", "conversations": [{"from": "gpt", "value": "hello there how can"},
                                              {"from": "human", "value": "tell me a joke"},
                                              {"from": "gpt", "value": "a b c d e"}]},
        {"id": "one", "conversations": [{"from": "human", "value": "only one turn here"}]},
        {"id": "empty", "conversations": []},
        {"id": "gptonly", "conversations": [{"from": "gpt", "value": "x y z w"}, {"from": "gpt", "value": "q r s t"}]},
        {"id": "blank", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a b c d"}]},
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a b c d"}]},
        {"id": "long", "conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "a b c d"}]},
    ]
    p = write(tmp_path, "sg.json", json.dumps(entries))
    wl = load_workload("sharegpt", WorkloadOptions(path=p, num_requests=10), RNG(0))
    assert sorted(r.source_id for r in wl.requests[:2]) == ["gptfirst", "ok"]
    by = {r.source_id: r for r in wl.requests}
    # the leading gpt turn is skipped: prompt = the human turn, reply = the gpt turn after it
    assert by["gptfirst"].prompt == "tell me a joke" and by["gptfirst"].output_tokens == 5
    # fallback counter: a word costs ceil(len/4) tokens → "how are you today" = 1+1+1+2 = 5
    assert by["ok"].prompt_tokens == 5 and by["ok"].output_tokens == 5
    assert wl.notes == {"leading_gpt_turn": 1}
    assert wl.skipped == {"single_turn": 1, "empty": 1, "no_human_gpt_pair": 1, "empty_turn": 1,
                          "prompt_too_short": 1, "prompt_too_long": 1}
    assert len(wl.requests) == 10 and any("reused" in w for w in wl.warnings)  # 2 usable → reused, ids unique
    assert len({r.request_id for r in wl.requests}) == 10


@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data (synthetic fallback rows have no source_id)")
def test_sharegpt_seeded_shuffle_is_deterministic():
    a = load_workload("sharegpt", WorkloadOptions(num_requests=20), RNG(3))
    b = load_workload("sharegpt", WorkloadOptions(num_requests=20), RNG(3))
    c = load_workload("sharegpt", WorkloadOptions(num_requests=20), RNG(4))
    assert [r.source_id for r in a.requests] == [r.source_id for r in b.requests]
    assert [r.source_id for r in a.requests] != [r.source_id for r in c.requests]
    assert "sharegpt_v3_sample500.json" in a.source


BURST_V1 = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
46,GPT-4,20,230,250,API log
50,ChatGPT,abc,3,3,Conversation log
"""

BURST_V3 = """Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
19440110.0,s1,43,GPT-4,906,446,1352,Conversation log
19440161.5,s2,2,ChatGPT,36,29,65,Conversation log
19440170.0,s3,2,ChatGPT,36,0,36,Conversation log
"""


def test_burstgpt_v1_and_v3_by_column_name(tmp_path):
    v1 = load_workload("burstgpt", WorkloadOptions(path=write(tmp_path, "b1.csv", BURST_V1)), RNG(0))
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_s) for r in v1.requests] == [(472, 18, 0.0), (20, 230, 41.0)]
    assert v1.skipped == {"failed_in_trace": 1, "malformed": 1} and v1.has_timestamps and "v1" in v1.source
    v3 = load_workload("burstgpt", WorkloadOptions(path=write(tmp_path, "b3.csv", BURST_V3)), RNG(0))
    assert [(r.prompt_tokens, r.output_tokens, r.arrival_s) for r in v3.requests] == [(906, 446, 0.0), (36, 29, 51.5)]
    assert v3.skipped == {"failed_in_trace": 1} and "v3" in v3.source
    # replay with --time-scale 0.5 halves the gaps
    t = arrival_times(ArrivalSpec("trace", time_scale=0.5), 2, RNG(0), [r.arrival_s for r in v3.requests])
    assert list(t) == [0.0, 25.75]


def test_wrong_csv_columns_and_missing_file(tmp_path):
    p = write(tmp_path, "bad.csv", "a,b\n1,2\n")
    with pytest.raises(AstroUserError, match="lacks column"):
        load_workload("burstgpt", WorkloadOptions(path=p), RNG(0))
    with pytest.raises(AstroUserError, match="no such file"):
        load_workload("azure", WorkloadOptions(path=tmp_path / "nope.csv"), RNG(0))
    with pytest.raises(AstroUserError, match="unknown workload"):
        load_workload("sharegtp", WorkloadOptions(), RNG(0))


def test_azure_and_length_trace(tmp_path):
    az = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    wl = load_workload("azure", WorkloadOptions(path=az), RNG(0))
    assert [(r.prompt_tokens, r.output_tokens) for r in wl.requests] == [(374, 44), (396, 109)]
    assert wl.requests[1].arrival_s == pytest.approx(4.314579)
    lt = write(tmp_path, "lt.csv",
               "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n3742,284,4026,0.07\n18,243,261,13.5\n")
    wl = load_workload("length-trace", WorkloadOptions(path=lt, max_total_tokens=4096), RNG(0))
    assert [(r.prompt_tokens, r.output_tokens) for r in wl.requests] == [(3742, 284), (18, 243)]
    wl = load_workload("length-trace", WorkloadOptions(path=lt), RNG(0))  # 4026 > 2048 → skipped
    assert wl.skipped == {"total_too_long": 1} and not wl.has_timestamps


def test_synthetic_prompt_has_exact_token_count():
    for n in (0, 1, 7, 300):
        assert count_tokens_fallback(synthetic_prompt(n, seed=n)) == n


def test_synthetic_lengths_follow_cited_fit():
    wl = load_workload("synthetic", WorkloadOptions(num_requests=4000, max_total_tokens=10_000), RNG(0))
    out = np.log([r.output_tokens for r in wl.requests])
    # lognormal(5.389, 1.067) clipped at 1734: median e^5.389 ≈ 219 tokens
    assert np.median(np.exp(out)) == pytest.approx(219, rel=0.08)
    assert "synthetic" in wl.source


@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data")
def test_llava_without_image_folder_uses_stand_ins_loudly(tmp_path):
    wl = load_workload("llava-instruct", WorkloadOptions(num_requests=5, image_dir=tmp_path / "absent"), RNG(0))
    assert len(wl.requests) == 5 and all(r.modality == "image" and r.num_images == 1 for r in wl.requests)
    assert all("<image>" not in r.prompt for r in wl.requests)
    assert wl.notes == {"image_stand_in": 5} and "IMAGE FOLDER ABSENT" in wl.warnings[0]
    part = wl.requests[0].media[0].content_part()
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/jpeg;base64,")


def test_llava_video_format_with_stand_in_video(tmp_path):
    recs = [{"id": "v1", "video": "clips/a.mp4", "data_source": "0_30_s_academic_v0_1",
             "conversations": [{"from": "human", "value": "<image>\nWhat happens in the clip?"},
                               {"from": "gpt", "value": "a man walks a dog"}]},
            {"id": "v2", "video": "clips/b.mp4", "data_source": "1_2_m_youtube",
             "conversations": [{"from": "human", "value": "Only one turn"}]}]
    p = write(tmp_path, "vid.json", json.dumps(recs))
    wl = load_workload("llava-video", WorkloadOptions(path=p, num_requests=1, max_frames=4,
                                                      video_dir=tmp_path / "none"), RNG(0))
    r = wl.requests[0]
    # "a man walks a dog" = 1+1+2+1+1 = 6 fallback tokens
    assert r.prompt == "What happens in the clip?" and r.output_tokens == 6 and r.num_frames == 4
    assert r.media[0].duration_s == 15.0 and "VIDEO FOLDER ABSENT" in wl.warnings[0]
    part = r.media[0].content_part()
    import base64

    data = base64.b64decode(part["video_url"]["url"].split(",", 1)[1])
    assert data[:4] == b"RIFF" and data[8:12] == b"AVI " and part["video_url"]["num_frames"] == 4


@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data")
def test_mix_ratios_are_exact():
    wl = load_workload("mix-mh", WorkloadOptions(num_requests=50, max_frames=2), RNG(0))
    mods = [r.modality for r in wl.requests]
    t, i, v = MIXES["mix-mh"]
    assert (mods.count("text"), mods.count("image"), mods.count("video")) == (20, 20, 10)
    assert (t, i, v) == (0.40, 0.40, 0.20)


# -- arrivals ----------------------------------------------------------------------------------

def test_gamma_arrivals_mean_and_cv():
    for b in (0.25, 1.0, 4.0):
        t = arrival_times(ArrivalSpec("gamma", rate_rps=20.0, burstiness=b), 40_001, RNG(1))
        gaps = np.diff(t)
        assert t[0] == 0.0
        assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)           # E[g] = 1/λ
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(b), rel=0.04)  # CV = 1/√b


def test_constant_inf_and_poisson_arrivals():
    assert list(arrival_times(ArrivalSpec("gamma", 4.0, math.inf), 3, RNG(0))) == [0.0, 0.25, 0.5]
    assert list(arrival_times(ArrivalSpec("constant", 2.0), 3, RNG(0))) == [0.0, 0.5, 1.0]
    assert list(arrival_times(ArrivalSpec("poisson", math.inf), 3, RNG(0))) == [0.0, 0.0, 0.0]
    a = arrival_times(ArrivalSpec("poisson", 5.0), 10, RNG(7))
    b = arrival_times(ArrivalSpec("poisson", 5.0), 10, RNG(7))
    assert list(a) == list(b)
    with pytest.raises(AstroUserError, match="no timestamps"):
        arrival_times(ArrivalSpec("trace"), 2, RNG(0), [None, None])


def test_rate_and_burstiness_rejected_at_parse_time():
    for bad in ("0", "-2", "nan", "fast"):
        with pytest.raises(AstroUserError):
            parse_positive(bad, "--request-rate")
    assert parse_positive("inf", "--burstiness") == math.inf
    with pytest.raises(AstroUserError):
        ArrivalSpec("gamma", 1.0, 0.0)
    assert parse_rates("20,10,15,10") == [10.0, 15.0, 20.0]
    with pytest.raises(AstroUserError):
        parse_rates("10,0")


def test_no_data_anywhere_falls_back_to_synthetic_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRO_DATA_DIR", str(tmp_path))  # an empty data folder
    wl = load_workload("sharegpt", WorkloadOptions(num_requests=5), RNG(0))
    assert len(wl.requests) == 5 and wl.name == "sharegpt"
    assert "synthetic" in wl.source and "SYNTHETIC" in wl.warnings[0]
    # the warning names the fix and the statistics' source in words, not a code constant
    w = wl.warnings[0]
    assert "--path FILE" in w and "ASTRO_DATA_DIR=<folder with sharegpt/" in w
    assert "Astrolabe paper's 10,000-request ShareGPT length trace" in w
    assert "SYNTHETIC_STATS" not in w and "SYNTHETIC_STATS" not in wl.source


def test_mix_without_data_is_synthetic_with_stand_ins(tmp_path, monkeypatch):
    monkeypatch.setenv("ASTRO_DATA_DIR", str(tmp_path))
    wl = load_workload("mix-ml", WorkloadOptions(num_requests=20, max_frames=2), RNG(0))
    mods = [r.modality for r in wl.requests]
    assert (mods.count("text"), mods.count("image"), mods.count("video")) == (16, 3, 1)  # 80/15/5 % of 20
    assert any("SYNTHETIC" in w for w in wl.warnings)
    assert all(m.stand_in for r in wl.requests for m in r.media)

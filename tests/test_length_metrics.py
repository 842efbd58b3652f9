"""Length-model metrics and reports, checked against hand-computed values."""

import json

import numpy as np
import pytest

from rps_astro_cli.length.base import LengthModel
from rps_astro_cli.length.evaluate import (
    bucket_of,
    compute_metrics,
    markdown_table,
    measure_latency,
    write_report,
)


def test_metrics_hand_computed():
    y = [10, 100, 300, 600]
    p = [20, 80, 300, 400]
    m = compute_metrics(y, p)
    # |err| = 10, 20, 0, 200
    assert m.n == 4
    assert m.mae == pytest.approx(57.5)
    assert m.median_ae == pytest.approx(15.0)
    # MAPE denominators max(y, 16) = 16, 100, 300, 600
    assert m.mape == pytest.approx(100 * (10 / 16 + 20 / 100 + 0 + 200 / 600) / 4)
    assert m.mape == pytest.approx(28.958333, rel=1e-6)
    assert m.mape_raw == pytest.approx(100 * (1 + 0.2 + 0 + 1 / 3) / 4)
    # buckets: y -> 0,1,2,3 ; p -> 0,1,2,2
    assert m.bucket_accuracy == pytest.approx(0.75)
    assert m.kendall_tau == pytest.approx(1.0)
    assert m.bias == pytest.approx(-52.5)


def test_kendall_one_discordant_pair():
    m = compute_metrics([10, 100, 300, 600], [80, 20, 300, 400])
    # 6 pairs, 1 discordant: (5 - 1) / 6
    assert m.kendall_tau == pytest.approx(4 / 6)


def test_bucket_edges():
    assert bucket_of(np.array([1, 63, 64, 255, 256, 511, 512, 5000])).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_metrics_reject_bad_shapes():
    with pytest.raises(ValueError):
        compute_metrics([1, 2], [1])
    with pytest.raises(ValueError):
        compute_metrics([], [])


class _Const(LengthModel):
    name = "const-test"

    def fit(self, train, val, *, rng, progress=None):
        return {}

    def _predict_raw(self, texts):
        return np.full(len(texts), 7.4)

    def save_files(self, directory):
        pass

    @classmethod
    def load_files(cls, directory, meta):
        return cls()


def test_predict_contract_and_latency():
    m = _Const()
    out = m.predict(["a", "", "b"])
    assert out.dtype == np.int64 and out.tolist() == [7, 7, 7]
    assert m.predict([]).shape == (0,)
    lat = measure_latency(m, ["x"] * 40, max_calls=20, batch_size=8)
    assert 0 <= lat.p50_ms_batch1 <= lat.p99_ms_batch1
    assert 0 <= lat.p50_ms_batched <= lat.p99_ms_batched
    assert lat.batch_size == 8


def test_report_files(tmp_path):
    y = np.array([10, 100, 300, 600])
    results = {"a": {"n": 4, "mae": 57.5}, "b": {"n": 4, "mae": float("nan")}}
    preds = {"a": np.array([20, 80, 300, 400]), "b": np.array([5, 5, 5, 5])}
    paths = write_report(results, preds, y, tmp_path, header="hdr")
    assert [p.name for p in paths] == ["metrics.json", "metrics.md", "scatter.png", "error_cdf.png"]
    assert json.loads(paths[0].read_text())["a"]["mae"] == 57.5
    md = paths[1].read_text()
    assert md.startswith("hdr") and "| a | 0 | 4 | 57.5 |" in md and "| b | 0 | 4 | n/a |" in md
    assert paths[2].read_bytes()[:4] == b"\x89PNG" and paths[3].stat().st_size > 1000
    assert markdown_table(results).count("\n") == 4

"""The request vocabulary (`rps_astro_cli.types`, and the service wires' bodies in
`rps_astro_cli.protocol.service_wire`): each wire's codec round-trips, reads the bodies
the services sent before it existed, and `types` stays at the bottom."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import rps_astro_cli.protocol.service_wire as w
import rps_astro_cli.types as t
from rps_astro_cli.errors import AstroUserError

LIMITS = t.InstanceConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=512)


def test_types_imports_nothing_of_ours_but_errors():
    tree = ast.parse(Path(t.__file__).read_text())
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.startswith("rps_astro_cli")}
    ours |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name.startswith("rps_astro_cli")}
    assert ours == {"rps_astro_cli.errors"}


def test_each_noun_of_types_has_one_import_path():
    """The vocabulary is imported from `rps_astro_cli.types` only: no module re-exports it
    (issue 30). One exception: the compiled look-ahead engine (`sim/lookahead_engine/`,
    built with mypyc) still imports `InstanceConfig` through `sim.instance` until its next
    rebuild, so `sim.instance` keeps that one re-export."""
    import rps_astro_cli.dispatch as dispatch_pkg
    import rps_astro_cli.dispatch.base as dispatch_base
    import rps_astro_cli.services.predictor as predictor
    import rps_astro_cli.sim.status as status

    nouns = {n.name for n in ast.parse(Path(t.__file__).read_text()).body if isinstance(n, ast.ClassDef)}
    nouns |= {"MODALITIES"}
    for mod in (dispatch_pkg, dispatch_base, predictor, status):
        assert not nouns & set(mod.__all__), mod.__name__
    assert not hasattr(dispatch_pkg, "DispatchDecision") and not hasattr(dispatch_pkg, "InstanceLoad")

    root = Path(t.__file__).parents[2]
    allowed = {("rps_astro_cli.sim.instance", "InstanceConfig")}  # the compiled engine's, see above
    elsewhere = []
    for path in [*(root / "src").rglob("*.py"), *(root / "tests").rglob("*.py")]:
        compiled = "lookahead_engine" in path.parts
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("rps_astro_cli") \
                    and n.module != "rps_astro_cli.types":
                elsewhere += [(str(path), n.module, a.name) for a in n.names if a.name in nouns
                              and not (compiled and (n.module, a.name) in allowed)]
    assert elsewhere == []


def test_request_status_wire_keys_and_old_computed_tokens_key():
    r = t.RequestStatus("a", 1.5, 40, 33, 2, 20, kv_blocks=3)
    d = r.to_dict()
    assert list(d) == ["request_id", "arrival_s", "prompt_tokens", "num_computed_tokens", "generated_tokens",
                       "predicted_output_tokens", "modality", "vision_tokens", "encoder_s", "req_class",
                       "kv_blocks", "deadline_s", "ready_s"]
    assert d["num_computed_tokens"] == 33 and t.RequestStatus.from_dict(d) == r
    old = {k: v for k, v in d.items() if k != "num_computed_tokens"} | {"computed_tokens": 33}
    back = t.RequestStatus.from_dict(old)
    assert back == r and back.computed_tokens == 33  # the old name still reads


def test_instance_status_round_trip_through_json():
    st = t.InstanceStatus("e0", 5.0, LIMITS, 57, running=(t.RequestStatus("r1", 4.0, 100, 100, 1, 3, kv_blocks=7),),
                          waiting=(t.RequestStatus("w1", 4.5, 30, modality="image", vision_tokens=20),),
                          policy={"name": "fcfs"}, profile_id="hand", num_preemptions_total=2,
                          arriving=(t.RequestStatus("a1", 4.9, 10, ready_s=5.2),))
    body = json.loads(json.dumps(st.to_dict()))
    assert body["kv_blocks_total"] == 64 and body["running"][0]["num_computed_tokens"] == 100
    assert t.InstanceStatus.from_dict(body) == st


def test_instance_status_bad_entry_names_list_and_index():
    body = t.InstanceStatus("e0", 5.0, LIMITS, 57).to_dict() | {"waiting": [{"request_id": "w", "arrival_s": 1.0,
                                                                              "prompt_tokens": 3, "bogus": 1}]}
    with pytest.raises(AstroUserError, match=r"waiting\[0\]") as ei:
        t.InstanceStatus.from_dict(body)
    assert ei.value.field == "status" and "num_computed_tokens" in str(ei.value)


def test_predict_request_round_trip_and_pre_codec_body():
    q = w.PredictRequest(t.CandidateRequest(812, 201, "image", 576, 0.03, 0.01, "pebbles"), "ttft")
    body = json.loads(json.dumps(q.to_dict()))
    assert body == {"prompt_tokens": 812, "predicted_output_tokens": 201, "modality": "image", "vision_tokens": 576,
                    "encoder_s": 0.03, "preprocess_s": 0.01, "req_class": "pebbles", "objective": "ttft"}
    assert w.PredictRequest.from_dict(body) == q
    # the body the scheduler sent without a tag (no media fields, no objective)
    old = w.PredictRequest.from_dict({"prompt_tokens": 7, "predicted_output_tokens": 256, "modality": "text"})
    assert old == w.PredictRequest(t.CandidateRequest(7, 256), "e2e")


@pytest.mark.parametrize("body, field", [
    ({"predicted_output_tokens": 3}, "prompt_tokens"),
    ({"prompt_tokens": True, "predicted_output_tokens": 3}, "prompt_tokens"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "vision_tokens": -1}, "vision_tokens"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "preprocess_s": "0"}, "preprocess_s"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "req_class": 3}, "req_class"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "deadline_s": "soon"}, "deadline_s"),
])
def test_predict_request_bad_field_is_named(body, field):
    with pytest.raises(AstroUserError) as ei:
        w.PredictRequest.from_dict(body)
    assert ei.value.field == field


def test_predict_reply_round_trip_and_estimate():
    rep = w.PredictReply(0.0201, 0.0404, 0.0201, 0.003, 250.0, "e0")
    assert w.PredictReply.from_dict(json.loads(json.dumps(rep.to_dict()))) == rep
    assert rep.estimate() == t.LatencyEstimate(0.0201, 0.0404, 0, 0)


def test_tag_result_round_trip_and_minimal_body():
    tag = w.TagResult(500, 11, 11, 0, "text", 0, 0, 0.0, 0.0, "baseline", 12.5)
    assert w.TagResult.from_dict(json.loads(json.dumps(tag.to_dict()))) == tag
    assert w.TagResult.from_dict({"predicted_output_tokens": 40, "prompt_tokens": 9}) == w.TagResult(40, 9)


def test_instance_load_status_fields_by_hand():
    # waiting: 33-token prompt holding 1 block needs ceil(33/16) - 1 = 2 more; a 10-token
    # prompt holding none needs 1; a 16-token one holding 1 needs 0 → 3 blocks
    st = t.InstanceStatus("e0", 5.0, LIMITS, 20, running=(t.RequestStatus("r", 0.0, 5),),
                          waiting=(t.RequestStatus("w1", 1.0, 33, kv_blocks=1), t.RequestStatus("w2", 1.0, 10),
                                   t.RequestStatus("w3", 1.0, 16, kv_blocks=1)))
    plain = {"kv_blocks_free": 20, "kv_blocks_total": 64, "num_running": 1, "num_waiting": 3,
             "waiting_blocks_needed": 3, "kv_block_size": LIMITS.block_size, "max_num_seqs": LIMITS.max_num_seqs,
             "pending_blocks_needed": None, "pending_requests": None}
    from rps_astro_cli.dispatch.loads import STATUS_ROW, status_fields_of

    row = status_fields_of(st)
    assert dict(zip(STATUS_ROW, row)) == plain


def test_decision_record_splices_the_decision_and_leaves_out_unset_fields():
    rec = t.DecisionRecord(3, "chat", 11, 40, 5.0)
    assert rec.to_dict() == {"request": 3, "endpoint": "chat", "prompt_tokens": 11, "predicted_output_tokens": 40,
                             "retries": 0, "tag_wait_us": 5.0}
    rec.decision = t.DispatchDecision("power_of_k", (0, 2), 2, "lowest e2e", {0: (0.1, 0.5), 2: (0.1, 0.4)}, 80.0)
    rec.instance, rec.observed_e2e_s, rec.overhead_us, rec.outcome = "engine-2", 0.41, 900.0, "ok"
    rec.received_unix_s = 1_764_900_000.25
    d = rec.to_dict()
    assert list(d) == ["request", "endpoint", "prompt_tokens", "predicted_output_tokens", "retries", "tag_wait_us",
                       "policy", "candidates", "predictions", "choice", "reason", "decide_us", "stage_us", "instance",
                       "observed_e2e_s", "overhead_us", "outcome", "received_unix_s"]
    assert d["received_unix_s"] == 1_764_900_000.25
    assert d["predictions"] == {"0": {"ttft_s": 0.1, "e2e_s": 0.5}, "2": {"ttft_s": 0.1, "e2e_s": 0.4}}

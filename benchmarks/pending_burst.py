"""Does counting dispatched-but-not-yet-visible requests stop a burst from herding?
(issue 13 §2; live path, one process on loopback threads.)

    .venv/bin/python benchmarks/pending_burst.py --repeats 3

Fleet: `--instances` sim engines (`--profile`, wall-clock time scale 1), one Predictor
each, one scheduler (`power_of_k` k=2, the bin-median baseline tagger in-process, so
every request gets the same predicted length). A burst of `--requests` streamed chat
requests, one every `--gap-ms`, is sent with `count_pending` on and off, alternating
(the order rotates per repeat). Per arm: the share of decisions whose two candidates got
identical predictions (the Predictors saw the same state for both — the herding
symptom), and the spread of requests over instances (max − min per instance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.sim.profile import load_profile


def one_burst(args, count_pending: bool, seed: int) -> dict[str, float]:
    prof = load_profile(args.profile)
    with ExitStack() as st:
        engs = [st.enter_context(ServerThread(sim_server.create_app(
            SimEngine(prof, time_scale=1.0, instance_id=f"engine-{i}", seed=i)))) for i in range(args.instances)]
        preds = [st.enter_context(ServerThread(pred_mod.create_app(
            pred_mod.PredictorSettings(e.url, profile=args.profile)))) for e in engs]
        eps = tuple(InstanceEndpoint(f"engine-{i}", e.url, p.url) for i, (e, p) in enumerate(zip(engs, preds)))
        s = st.enter_context(ServerThread(create_app(SchedulerSettings(
            instances=eps, policy="power_of_k", policy_params={"k": 2}, length_model="baseline", seed=seed,
            predict_deadline_s=0.5, count_pending=count_pending))))
        model = httpx.get(engs[0].url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "word " * args.prompt_words}],
                "max_tokens": args.max_tokens, "stream": True}
        with httpx.Client(base_url=s.url, timeout=30) as c:  # warm: connections, profile load
            c.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        n0 = len(httpx.get(s.url + "/decisions", params={"n": 1000}, timeout=5).json())

        def send() -> None:
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_bytes():
                    pass

        threads = []
        for _ in range(args.requests):
            t = threading.Thread(target=send)
            t.start()
            threads.append(t)
            time.sleep(args.gap_ms / 1000)
        for t in threads:
            t.join(timeout=60)
        decs = httpx.get(s.url + "/decisions", params={"n": 1000}, timeout=5).json()[n0:]
    same = sum(1 for d in decs if len(d["predictions"]) == 2
               and len({round(p["e2e_s"], 9) for p in d["predictions"].values()}) == 1)
    per: dict[str, int] = {}
    for d in decs:
        per[d["instance"]] = per.get(d["instance"], 0) + 1
    counts = [per.get(f"engine-{i}", 0) for i in range(args.instances)]
    return {"identical_share": same / max(1, len(decs)), "spread": max(counts) - min(counts), "n": len(decs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write every repeat's figures here")
    args = ap.parse_args()
    res: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.repeats):
        for arm in ((True, False) if r % 2 == 0 else (False, True)):
            res[arm].append(one_burst(args, arm, r))
            print(f"repeat {r} count_pending={arm}: {res[arm][-1]}", flush=True)
    print("\n| count_pending | identical predictions, share of decisions: median (min–max) | "
          "requests per instance, max − min: median (min–max) |\n|---|---|---|")
    for arm in (False, True):
        sh = [x["identical_share"] for x in res[arm]]
        sp = [x["spread"] for x in res[arm]]
        print(f"| {'on' if arm else 'off'} | {statistics.median(sh):.2f} ({min(sh):.2f}–{max(sh):.2f}) | "
              f"{statistics.median(sp):g} ({min(sp):g}–{max(sp):g}) |")
    if args.json:
        out = {"args": {k: v for k, v in vars(args).items() if k != "json"},
               "count_pending_on": res[True], "count_pending_off": res[False]}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

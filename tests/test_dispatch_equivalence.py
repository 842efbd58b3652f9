"""Fixed-seed virtual-cluster runs give the same per-request results as before the
dispatch pipeline (issue 12): the digests below were recorded on commit fe1a52e (the
last commit before the refactor) with `scripts/dispatch_equivalence.py`'s scenarios,
60 requests on 4 instances. A digest covers every request's instance, dispatch /
first-token / finish times (bit-exact reprs), preemptions, class and the predicted
TTFT/E2E the dispatcher saw. If a change moves them on purpose, say why in the commit
and re-record them (the script prints them)."""

from __future__ import annotations

from conftest import load_script

RECORDED_FE1A52E = [
    'round_robin     {}                               fcfs         noise=None  2dbdb738f6d91bf6  per-instance=[15, 15, 15, 15]',  # noqa: E501
    'random          {}                               fcfs         noise=None  6cf99b7dd6cd2974  per-instance=[11, 15, 14, 20]',  # noqa: E501
    'least_requests  {}                               fcfs         noise=None  23cb2b966e06ca7a  per-instance=[16, 13, 15, 16]',  # noqa: E501
    'llumnix         {}                               fcfs         noise=None  fed3a54aa99e4015  per-instance=[15, 16, 15, 14]',  # noqa: E501
    "llumnix         {'variant': 'code'}              fcfs         noise=None  838a3ed9c0df1bbe  per-instance=[15, 15, 15, 15]",  # noqa: E501
    "power_of_k      {'k': 2}                         fcfs         noise=None  ceefab516ba55fd4  per-instance=[15, 14, 16, 15]",  # noqa: E501
    "power_of_k      {'k': 3, 'objective': 'ttft'}    fcfs         noise=None  85c0e46e63042626  per-instance=[16, 15, 15, 14]",  # noqa: E501
    "power_of_k      {'k': 'all'}                     fcfs         noise=None  92d25f98495da261  per-instance=[14, 14, 17, 15]",  # noqa: E501
    "power_of_k      {'k': 2}                         rps          noise=None  9f727d9a5913ddd1  per-instance=[15, 14, 16, 15]",  # noqa: E501
    "power_of_k      {'k': 2}                         fcfs         noise=(0.5, 0.5)  150e99abb3856acd  per-instance=[11, 16, 14, 19]",  # noqa: E501
    'least_requests  {}                               naive_class  noise=None  9b3bf0fcae908f52  per-instance=[16, 13, 15, 16]',  # noqa: E501
]


def test_virtual_cluster_per_request_results_are_bit_identical_to_fe1a52e():
    mod = load_script("scripts/dispatch_equivalence.py", "dispatch_equivalence")
    assert mod.scenario_lines(60, 14.0, 4) == RECORDED_FE1A52E

"""Offline measurement and fitting, run before serving: the workload profiler
(`profiler`, RPS-Serve §3.2) and the fit of RPS-Serve's impact estimator and classifier
from its CSV (`rps_fit`); the execution-time profile fitter from GPU profiling CSVs
(`fit_profiles`, with `hardware`, `fitting`, `linear_layers`, `attention`, `assembly`
and `llava`); the vLLM step-log calibration (`vllm_calibrate`). Commands:
`astro profile`, `astro fit`, `astro profiles fit`; no module here has its own CLI."""

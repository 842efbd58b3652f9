"""The one instance simulator core: execution-time profiles, the vLLM-V1-faithful
step model (`InstanceSim`), the fast jump look-ahead used by the Predictor, and helpers
shared by the sim engine and the virtual-time cluster simulation."""

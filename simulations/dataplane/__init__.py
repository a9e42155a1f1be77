"""A flow-level data-plane simulator at cluster scale (issue 17): a GPU fabric
(:mod:`.fabric`), many fan-outs at once on it driven by the real sessions, planner and
coordinator (:mod:`.fanouts`), the paper's workloads and our ablations
(:mod:`.workloads`), the baselines' algorithms (:mod:`.baselines`) and the check
against the emulated cluster (:mod:`.validate`).  ``python -m simulations.paper``."""

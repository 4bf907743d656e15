"""Eval: measuring the strategies. Datasets, per-request metrics, the strategies themselves (`strategies/`, one
class each), the `edgekv eval` job (`eval_job.py`: runner, shards, merge), reports (Table II, `report.py`;
bootstrap and paired differences, `stats.py`; quality per byte), Poisson load runs, the fidelity harness (NLL
over spliced prefixes), the network model and planner (`network.py`, `plan_job.py`: `edgekv plan`).

May import every other stage; nothing imports it.
"""

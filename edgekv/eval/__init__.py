"""Eval: measuring the strategies. Datasets, per-request metrics, the strategies themselves (`strategies/`, one
class each) and what they receive (`artefacts.py`: models, link, mappings, translators, exports), one request
answered and measured (`scoring.py`), runs on disk (`runs.py`: resume, shards, merge), the eval's settings and
sample (`eval_config.py`), the `edgekv eval` job (`eval_job.py`), reports (Table II, `report.py`;
bootstrap and paired differences, `stats.py`; quality per byte), Poisson load runs, the fidelity harness (NLL
over spliced prefixes), the network model and planner (`network.py`, `plan_job.py`: `edgekv plan`).

May import every other stage; nothing imports it.
"""

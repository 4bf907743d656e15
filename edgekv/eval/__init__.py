"""Eval: measuring the strategies. Datasets, per-request metrics, the fidelity harness (NLL over spliced
caches), Poisson load runs, reports (Table II), and the `edgekv eval` job (`eval_job.py`).

May import every other stage; nothing imports it.
"""

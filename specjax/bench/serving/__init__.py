"""Measuring a server under load, from the client's side: load generation
(Poisson arrivals of held-out prompts, in process or over HTTP, a sweep over
rates and modes) in `.load`, a sweep's report (pooled, compared, tabulated,
plotted) in `.load_report`, and the soak under hostility in `.soak`.

The server itself is `specjax.serving`; the launcher is `experiments/load_test.py`
(its job: `specjax.jobs.load_test`).
"""

"""kvpilot on Ray Serve: replica pools ("lanes") of kvpilot engines behind one OpenAI endpoint, with
prefix-cache-aware routing (`kvpilot serve --ray`, or `serve run kvpilot.ray:app`; docs/ray.md).

Only ingress.py, replica.py, router.py, stats_hub.py and app.py import ray; config, lanes, prefix_key,
affinity, forward and metrics_merge are plain Python, tested without a cluster.
"""

"""Disaggregated serving's router side: the prefill/decode hand-off (handoff.py) and `kvpilot proxy`."""

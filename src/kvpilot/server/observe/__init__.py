"""What the server tells about itself: Prometheus metrics, per-request timings and the access log,
traces, the dashboard, the status line, process memory, and its own output (log_writer)."""

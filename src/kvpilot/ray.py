"""`serve run kvpilot.ray:app model=... num_replicas=2` (or `config=FILE`): kvpilot as a Ray Serve application.

The application lives in kvpilot.server.ray_app (docs/ray.md); this module is its short import path.
Needs `pip install 'kvpilot[ray]'`.
"""

from __future__ import annotations

from kvpilot.server.ray_app.app import app, build_application
from kvpilot.server.ray_app.config import RayAppConfig, parse_app_config

__all__ = ["RayAppConfig", "app", "build_application", "parse_app_config"]

"""Errors a `kvpilot doctor` user can cause; the CLI prints the message on one line and exits 2."""

from __future__ import annotations


class DoctorInputError(ValueError):
    """Input the doctor cannot use (unreadable file, no measured requests, bad flag); says what to do."""

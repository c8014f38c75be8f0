"""kvpilot.doctor: name the bottleneck of a slow deployment from bench results and /metrics text.

Entry points: :func:`kvpilot.doctor.inputs.load_inputs` (files -> :class:`DoctorInputs`),
:func:`kvpilot.doctor.diagnose.diagnose` (inputs -> :class:`DoctorReport`), the renderers in
``render_console`` / ``render_html`` (``doctor_html_section``), and ``cli.doctor_command``.
"""

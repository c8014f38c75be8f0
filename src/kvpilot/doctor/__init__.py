"""kvpilot.doctor"""

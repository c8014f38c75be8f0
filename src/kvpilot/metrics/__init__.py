"""kvpilot.metrics"""

"""kvpilot.server"""

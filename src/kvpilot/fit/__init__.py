"""kvpilot.fit"""

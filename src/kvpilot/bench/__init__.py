"""kvpilot.bench"""

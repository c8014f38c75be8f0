"""kvpilot.model"""

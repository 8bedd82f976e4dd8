"""Backends that lower a plan: triton (sm_90, sm_100, interpreter)."""
